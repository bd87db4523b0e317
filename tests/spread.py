"""How the suite is spread over pytest-xdist workers (pyproject.toml: `-n ... --dist loadgroup`).

A unit of work is a test file, or files that share an expensive session fixture (GROUPS): a worker runs a unit's
tests in turn, so a module or session fixture (an engine, a trained draft, installed wheels) is set up once, on one
worker. The scheduler reads a test's unit from its node id (unit_of_nodeid), not from xdist_group marks: xdist
passes a mark on by renaming the test (`item._nodeid`), which pytest 9.2 no longer reads, and then every test was
a unit of its own (CI, 2026-12-03: the quality run's two tests each trained a draft, at once, on two workers).

The longest unit goes first (SECONDS, measured in CI), and a worker takes its next unit only when it is about to
run the last test of the current one, so a long unit (the quality run, ~15 minutes beside the others) does not hold
other units queued behind it while the other workers run dry: the suite ends when its longest chain of work does.

The tests in ALONE run last, one worker on its own, once the other workers have stopped taking work.
"""

from __future__ import annotations

from pathlib import Path

# Files that share a session fixture of conftest.py run on one worker, which sets it up once; and files that must not
# run at the same time.
GROUPS = {
    # `trained` (a full training run) and `speculators_site` (speculators 0.9.0 pip-installed)
    "test_train.py": "trained", "test_spec_trainer.py": "trained", "test_parity.py": "trained",
    # `golden_installs` (three speculators wheels downloaded and installed)
    "test_patch_engine.py": "speculators-wheels", "test_deploy_patch.py": "speculators-wheels",
    "test_concurrent_payloads.py": "speculators-wheels",
    # Each starts a Slurm cluster of its own, but Slurm's names (cluster kimitest, nodes n0 and n1) are the same.
    "test_slurm.py": "slurm", "test_slurm_truth.py": "slurm",
}

# Session fixtures cheap enough to set up on every worker (tests/test_levels.py checks that the files sharing any
# other session fixture are one unit).
CHEAP = {"sshd"}

# Seconds a unit took in CI run serially (the JUnit XML of the run of 2026-12-03, rounded), longest first; a unit not
# listed counts a second per test. Only the order matters: a stale figure costs time, never a result.
# Not refreshed on purpose: the README run of 2026-12-06 on the AVX2-only box with these figures replaced by that
# box's own (the longest truly first) took 61.8 min and 6,002 CPU-seconds, against 50.3 min and 4,981 with these
# (the same tests but two). The heavy units, started together, each took 1.27-1.45x their CPU-seconds beside one
# another (vLLM engines and OpenMP threads contending), the light ones 0.8-1.1x; these figures happen to interleave
# heavy units with light ones. One run each: the box's own variation is not ruled out.
SECONDS = {
    # The quality run first: one thread beside the other workers (test_quality.py), so it runs while they do. Run last
    # and alone (until 2026-12-04) it held both cores for ~11 minutes at 1.46 of them, the others idle.
    "test_quality.py": 1500,
    "test_vllm_backends.py": 404, "test_regenerate_eval.py": 331, "test_kimi_vllm.py": 175,
    "slurm": 167, "test_choose.py": 143, "test_torchrun.py": 141, "test_known_acceptance.py": 137,
    "test_group_jobs.py": 136, "trained": 116, "test_self_prompts.py": 113,
    "test_online_vllm.py": 100, "test_online.py": 98, "test_pull_clean.py": 97, "test_data_manifest.py": 89,
    "test_machine_claims.py": 82, "test_pipeline_data.py": 75, "test_group_truth.py": 73, "speculators-wheels": 65,
    "test_extract_resume_key.py": 62, "test_engine_memory_steps.py": 54, "test_preflight_cli.py": 53,
    "test_jobs.py": 52, "test_jobs_gpu_truth.py": 49,
    "test_bench_gpu_scaling.py": 150,   # added 2026-12-06 (150 s alone on the idle box): not last
}


# Tests that send Ctrl-C a measured fraction of the way into a start or a stop, to hit both of its outcomes: on a
# box loaded by three other workers a later start ran so much faster or slower than the measured one that an
# outcome was missed (test_start_interrupt [local], and a stop's grace period, at 4 workers on 2 cores). A file, or a
# file::function.
ALONE = {
    "test_start_interrupt.py",
    "test_machine_claims.py::test_a_stop_cut_short_by_ctrl_c_leaves_the_job_running_and_a_second_stop_ends_it",
}
ALONE_UNIT = "alone"


def unit_of(path: str, function: str = "") -> str:
    """The unit (xdist group) of test `function` of file `path`."""
    name = Path(path).name
    if name in ALONE or f"{name}::{function}" in ALONE:
        return ALONE_UNIT
    return GROUPS.get(name, name)


def unit_of_nodeid(nodeid: str) -> str:
    """The unit of a test's node id as the controller sees it ("tests/test_x.py::Class::test_y[param]", with an
    "@group" suffix where xdist's renaming works)."""
    path, _, inside = nodeid.partition("::")
    function = inside.split("[", 1)[0].split("@", 1)[0].rsplit("::", 1)[-1]
    return unit_of(path, function)


def make_scheduler(config, log):
    """xdist's loadgroup scheduling, longest unit first, the next unit taken only when a worker needs it."""
    from xdist.scheduler import LoadGroupScheduling

    class LongestFirst(LoadGroupScheduling):
        def _split_scope(self, nodeid):
            return unit_of_nodeid(nodeid)

        def _assign_work_unit(self, node):
            units = [u for u in self.workqueue if u != ALONE_UNIT]
            if not units and not all(n.shutting_down for n in self.nodes if n is not node):
                node.shutdown()   # ALONE is left: the last worker taking work runs it, beside the others' last tests
                return
            units = units or list(self.workqueue)
            longest = max(units, key=lambda u: (SECONDS.get(u, len(self.workqueue[u])), -units.index(u)))
            self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

        def _reschedule(self, node):
            # A worker runs a test only once it knows the next one (xdist passes it to the teardown), so it needs
            # more work when a single test is left of what it has; xdist's own rule (two left) took the next unit
            # while a long one had most of its time ahead.
            if node.shutting_down or self._pending_of(self.assigned_work[node]) > 1:
                return
            if self.workqueue:
                self._assign_work_unit(node)
            else:
                node.shutdown()

    return LongestFirst(config, log)
