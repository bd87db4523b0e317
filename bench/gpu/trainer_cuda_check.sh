#!/bin/bash
# CUDA check of the trainer on random 1B-shaped inputs (hidden 2048, draft vocab 8192, TTT 3, 16384 tokens/step):
# flex attention + compile tokens/s on 1 GPU; the same 20 steps stopped at step 10 and resumed on 1 GPU, whose final
# loss must equal the straight run's; DDP on 2 GPUs stopped half-way and resumed on 1 GPU, FSDP on 2 GPUs (the
# 2-GPU runs are skipped on a one-GPU machine).
# About 4.5 minutes on the 2-GPU H200 machine with warm compile caches (a cold first step compiles ~2 min):  PYTHON=/opt/torch/.venv/bin/python3 OUT=./out bash bench/gpu/trainer_cuda_check.sh
# Writes $OUT/{one,half,half_resume,ddp,resume,fsdp}.json (each run's JSON answer) and .log; prints a summary.
# A CPU rehearsal (tests/test_bench_gpu_scaling.py): TC_CPU_REHEARSAL=1 runs the 2-GPU part as 2 gloo processes, with
# TC_TOKENS_PER_STEP and random_train_inputs.py's RT_* sizes small.
cd "$(dirname "$0")/../.."
# The steps run as modules of this checkout's kimi_eagle_host, as on a host.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-/opt/torch/.venv/bin/python3}
export OUT=${OUT:-./out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PATH=$PATH:/usr/local/nvidia/bin
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
D=${TC_DIR:-/dev/shm/kimi-eagle-trainer-check-$$}; rm -rf $D   # this run's own: two at once do not share it
$PY bench/gpu/random_train_inputs.py $D 40 || exit 1
TR="-m kimi_eagle_host.pipeline.train --model $D/target --tokens-per-step ${TC_TOKENS_PER_STEP:-16384} --epochs 100 --log-every 5 --save-every 1000"
copy() { rm -rf $D/$1; mkdir -p $D/$1; ln -s $D/out/hidden_states $D/$1/hidden_states; ln -s $D/out/vocab $D/$1/vocab; }
copy one; CUDA_VISIBLE_DEVICES=0 timeout 300 $PY $TR --output-dir $D/one --max-steps 20 > $OUT/one.json 2> $OUT/one.log; echo "one rc=$?"
copy half; CUDA_VISIBLE_DEVICES=0 timeout 240 $PY $TR --output-dir $D/half --max-steps 20 --stop-at-step 10 > $OUT/half.json 2> $OUT/half.log; echo "half rc=$?"
CUDA_VISIBLE_DEVICES=0 timeout 120 $PY $TR --output-dir $D/half --max-steps 20 --resume > $OUT/half_resume.json 2> $OUT/half_resume.log; echo "half_resume rc=$?"
$PY -c "
import json
last = lambda f: json.loads(open(f).read().strip().splitlines()[-1])
a, b = last('$OUT/one.json'), last('$OUT/half_resume.json')
print('resume on 1 GPU: final loss', a.get('final_loss'), 'straight,', b.get('final_loss'), 'stopped at 10 and resumed:',
      'EQUAL' if a.get('final_loss') == b.get('final_loss') is not None else 'DIFFERENT')"
runs="one half half_resume"
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -lt 2 ] && [ -z "${TC_CPU_REHEARSAL:-}" ]; then echo "ddp, resume, fsdp: skipped (one GPU)"; else
runs="$runs ddp resume fsdp"
copy ddp; timeout 100 $PY -m torch.distributed.run --standalone --nproc-per-node 2 $TR --output-dir $D/ddp --max-steps 20 --stop-at-step 10 > $OUT/ddp.json 2> $OUT/ddp.log; echo "ddp rc=$?"
CUDA_VISIBLE_DEVICES=0 timeout 90 $PY $TR --output-dir $D/ddp --max-steps 20 --resume > $OUT/resume.json 2> $OUT/resume.log; echo "resume rc=$?"
$PY -c "
import json
last = lambda f: json.loads(open(f).read().strip().splitlines()[-1])
a, b = last('$OUT/one.json'), last('$OUT/resume.json')
x, y = a.get('final_loss'), b.get('final_loss')
close = x is not None and y is not None and abs(x - y) <= 1e-3 * abs(x)
print('resume of 2 GPUs on 1: final loss', x, 'straight on 1,', y, 'stopped on 2 at 10 and resumed on 1:',
      'CLOSE' if close else 'DIFFERENT', '(the same global batches; DDP sums in another order)')"
copy fsdp; timeout 100 $PY -m torch.distributed.run --standalone --nproc-per-node 2 $TR --output-dir $D/fsdp --max-steps 10 --parallel fsdp > $OUT/fsdp.json 2> $OUT/fsdp.log; echo "fsdp rc=$?"
fi
for f in $runs; do echo "== $f"; $PY -c "
import json,sys
try: d=json.loads(open('$OUT/$f.json').read().strip().splitlines()[-1])
except Exception as e: print('no json', e); sys.exit()
print({k:d.get(k) for k in ('ok','error','world_size','parallel','attention','compiled','rows_per_step','pack_len','train_tokens_per_s','cuda_peak_mem_gb','resumed_from_step','finished')})
print([(h['step'],round(h['loss'],3),h['tokens_per_s']) for h in d.get('history',[])])
"; grep -i "error\|Traceback\|resumed" $OUT/$f.log | head -5; done
rm -rf $D
