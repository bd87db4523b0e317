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

# Seconds a unit took in the README's test command on the AVX2-only 2-core box at 4 workers (the JUnit XML of the run of
# 2026-12-06, summed per unit, rounded), longest first; a unit not listed counts a second per test. Only the order
# matters: a stale figure costs time, never a result (units the 2026-12-03 figures put near the end, such as
# test_bench_campaign.py at 240 s, were started last and ran on while the other workers stood idle).
SECONDS = {
    # The quality run first: one thread beside the other workers (test_quality.py), so it runs while they do. Run last
    # and alone (until 2026-12-04) it held both cores for ~11 minutes at 1.46 of them, the others idle.
    "test_quality.py": 1470,
    "test_regenerate_eval.py": 1070, "test_vllm_backends.py": 1050, "test_kimi_vllm.py": 660, "test_choose.py": 600,
    "slurm": 490, "test_online.py": 480, "test_torchrun.py": 460, "test_known_acceptance.py": 400,
    "test_online_vllm.py": 370, "test_self_prompts.py": 340, "trained": 290, "test_group_jobs.py": 280,
    "test_pull_clean.py": 260, "test_pipeline_data.py": 260, "test_engine_memory_steps.py": 260,
    "test_bench_campaign.py": 240, "test_data_manifest.py": 210, "speculators-wheels": 190, "test_jobs.py": 170,
    "test_jobs_gpu_truth.py": 130, "test_preflight_cli.py": 130, "test_machine_claims.py": 120,
    "test_group_truth.py": 120, "test_storage_plan.py": 100, "test_preflight_kimi_size.py": 100,
    "test_preflight_payload.py": 90, "test_input_guards.py": 90, "test_hosts.py": 70,
    "test_vllm_env_defaults.py": 70, "test_recipes.py": 60,
    "test_bench_gpu_scaling.py": 300,   # new on 2026-12-06: 150 s on the idle box, two tests
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
