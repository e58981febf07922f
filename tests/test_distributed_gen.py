"""Generation on a local Ray cluster (``--distributor ray``) against the ``local`` loop.

One Ray cluster (2 CPUs) serves the whole module; the tiny random LLaVA-NeXT runs on the
transformers engine in each worker. Shards are the unit of work, so a run on Ray must give
exactly the keys and texts of a local run, and a killed worker or driver loses at most the
shards in flight: the rerun completes the range with no duplicate and no missing key.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="needs Ray: pip install -e '.[distributed]' (or pip install ray)")

from demind.cli.generate import main as generate_main  # noqa: E402
from demind.engines.tiny_llava import build_tiny_llava_next  # noqa: E402
from helpers import make_sample, write_input_shard  # noqa: E402
from test_data_gen import base_argv, read_output  # noqa: E402

SHARDS, PER_SHARD = 4, 6


@pytest.fixture(scope="module")
def ray_cluster():
    """A local 2-CPU Ray cluster for the module; yields its address (for driver subprocesses)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_llava_next(tmp_path_factory.mktemp("tiny-llava-next"))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Four img2dataset-style shards of six samples each."""
    root = tmp_path_factory.mktemp("in")
    for shard in range(SHARDS):
        write_input_shard(root / f"{shard:05d}.tar", [
            make_sample(f"{shard:05d}{i:04d}", 10 * shard + i, f"a dog {shard} {i} on a red street")
            for i in range(PER_SHARD)])
    return root


@pytest.fixture(scope="module")
def local_texts(repo_root, tiny, inputs, tmp_path_factory) -> dict:
    """The reference: the same job through ``--distributor local``."""
    out = tmp_path_factory.mktemp("local")
    assert generate_main(argv(repo_root, tiny, inputs, out)) == 0
    return samples_by_key(out)


def argv(repo_root: Path, tiny: Path, inp: Path, out: Path, *extra: str) -> list[str]:
    return base_argv(repo_root, tiny, inp, out, "engine.batch_size=2", *extra)


def samples_by_key(out: Path) -> dict[str, tuple[bytes, bytes]]:
    """key -> (T_rew, T_int) over every output shard; a key written twice fails the test."""
    keys, texts = [], {}
    for tar in sorted(out.glob("*.tar")):
        for s in read_output(tar):
            keys.append(s["__key__"])
            texts[s["__key__"]] = (s["rew.txt"], s["int.txt"])
    assert len(keys) == len(set(keys)), "a key was written twice"
    return texts


def assert_complete(out: Path, local_texts: dict) -> None:
    assert samples_by_key(out) == local_texts
    assert sorted(p.name for p in out.glob("*_stats.json")) == [f"{i:05d}_stats.json" for i in range(SHARDS)]
    assert not list(out.glob("*.tmp"))


def both_workers_mid_shard(out: Path):
    """True while two shards are being written (each worker's ``.tar.tmp`` exists): a kill now
    lands inside a shard."""
    return lambda: len(list(out.glob("*.tar.tmp"))) == 2


def kill_when(condition, action, timeout: float = 120.0) -> threading.Thread:
    """In the background: once ``condition()`` holds, run ``action()`` (the kill)."""
    def watch() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not condition():
            time.sleep(0.02)
        action()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_two_ray_workers_give_the_texts_of_a_local_run(repo_root, ray_cluster, tiny, inputs, local_texts, tmp_path,
                                                       capsys):
    out = tmp_path / "ray"
    assert generate_main(argv(repo_root, tiny, inputs, out, "--distributor", "ray", "--workers", "2")) == 0
    assert_complete(out, local_texts)
    printed = capsys.readouterr().out
    assert "ray: 2 worker(s)" in printed and "finished 4 shard(s); 0 already done; 0 failed" in printed
    assert "0 shard(s) retried" in printed and "ms/shard" in printed
    stats = json.loads((out / "00002_stats.json").read_text())
    assert stats["samples_in"] == PER_SHARD and stats["written"] == PER_SHARD  # per-shard stats as a local run's

    assert generate_main(argv(repo_root, tiny, inputs, out, "--distributor", "ray", "--workers", "2")) == 0
    assert "already done    :      4  (0-3)" in capsys.readouterr().out  # a rerun skips finished shards


@pytest.mark.slow
def test_killed_worker_loses_only_its_shard_and_the_rerun_completes(repo_root, ray_cluster, tiny, inputs, local_texts,
                                                                   tmp_path, capsys):
    """One try per shard: the shard in flight on the killed worker is reported failed; the rerun does it."""
    out = tmp_path / "ray"
    killer = kill_when(both_workers_mid_shard(out), lambda: ray.kill(ray.get_actor("demind-generate-0"), no_restart=True))
    code = generate_main(argv(repo_root, tiny, inputs, out, "--distributor", "ray", "--workers", "2",
                              "--shard-attempts", "1"))
    killer.join()
    printed = capsys.readouterr().out
    assert code == 1 and "FAILED: 1 tries: worker 0 died" in printed, printed
    assert len(list(out.glob("*_stats.json"))) == SHARDS - 1  # only the shard in flight on worker 0 is lost
    assert generate_main(argv(repo_root, tiny, inputs, out, "--distributor", "ray", "--workers", "2")) == 0
    assert_complete(out, local_texts)


@pytest.mark.slow
def test_killed_worker_shard_is_retried_on_the_other_worker(repo_root, ray_cluster, tiny, inputs, local_texts,
                                                           tmp_path, capsys):
    out = tmp_path / "ray"
    killer = kill_when(both_workers_mid_shard(out), lambda: ray.kill(ray.get_actor("demind-generate-1"), no_restart=True))
    assert generate_main(argv(repo_root, tiny, inputs, out, "--distributor", "ray", "--workers", "2")) == 0
    killer.join()
    assert_complete(out, local_texts)  # in one run: the dead worker's shard went to worker 0
    printed = capsys.readouterr().out
    assert "finished 4 shard(s)" in printed and "1 shard(s) retried after a failed try" in printed, printed
    assert "done after: worker 1 died" in printed


@pytest.mark.slow
def test_killed_driver_then_rerun_completes(repo_root, ray_cluster, tiny, inputs, local_texts, tmp_path, capsys):
    """kill -9 of the driver mid-job: Ray ends its workers; the same command completes the range."""
    out = tmp_path / "ray"
    env = dict(os.environ, PYTHONPATH=str(repo_root), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(repo_root / "data_gen/run.py"), *argv(repo_root, tiny, inputs, out, "--distributor", "ray",
                                                              "--workers", "2", "--ray-address", ray_cluster)]
    driver = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while not list(out.glob("*_stats.json")) and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert driver.poll() is None, driver.communicate()[0][-3000:]  # still running: killed mid-job
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    assert len(list(out.glob("*_stats.json"))) < SHARDS
    assert generate_main(argv(repo_root, tiny, inputs, out, "--distributor", "ray", "--workers", "2")) == 0
    assert_complete(out, local_texts)


def test_ray_settings_without_ray_distributor_are_refused(repo_root, tiny, inputs, tmp_path, capsys):
    assert generate_main(argv(repo_root, tiny, inputs, tmp_path / "o", "--workers", "2")) == 2
    assert "workers" in capsys.readouterr().err


@pytest.mark.slow
def test_workers_that_cannot_load_the_engine_are_one_error(repo_root, ray_cluster, tiny, inputs, tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    code = generate_main(argv(repo_root, tiny, inputs, tmp_path / "out", f"engine.model={missing}",
                              "--distributor", "ray", "--workers", "2"))
    err = capsys.readouterr().err
    assert code == 2 and "no Ray worker could start its engine" in err and "no-such-model" in err, err


def test_worker_resources_and_count():
    from demind.gen.config import GenConfig
    from demind.gen.ray_job import worker_resources
    from demind.distributed import DistributedJobError, count_workers

    cfg = GenConfig()
    cfg.engine.tensor_parallel_size = 2
    gpu_cluster = {"CPU": 64.0, "GPU": 8.0}
    resources = worker_resources(cfg, gpu_cluster, "head:6379")
    assert resources == {"num_cpus": 1, "num_gpus": 2}  # vLLM: tensor_parallel_size GPUs per worker
    assert count_workers(0, resources, gpu_cluster, shards=100) == 4 and count_workers(0, resources, gpu_cluster, 3) == 3
    cfg.engine.name = "transformers"
    assert worker_resources(cfg, gpu_cluster, None)["num_gpus"] == 1
    cfg.run.device, cfg.engine.cpu_threads = "cpu", 4
    cpu = worker_resources(cfg, gpu_cluster, None)
    assert cpu == {"num_cpus": 4, "num_gpus": 0} and count_workers(3, cpu, gpu_cluster, 100) == 3
    with pytest.raises(DistributedJobError, match="--workers N"):
        count_workers(0, cpu, {"CPU": 2.0}, 10)
    cfg.run.device = "cuda"
    with pytest.raises(DistributedJobError, match="has no GPU"):
        worker_resources(cfg, {"CPU": 2.0}, None)


def test_a_failed_shard_goes_to_another_worker_then_is_reported_after_its_tries():
    """The driver's bookkeeping, without a cluster: a failed try puts the shard back at the queue's
    front for a worker that has not failed it; after ``shard_attempts`` tries it is reported, with
    every try's error, and the job goes on with the other shards."""
    from collections import deque

    from demind.gen.runner import JobSummary
    from demind.gen.plan import ShardTask
    from demind.gen.ray_job import RayOptions, _Dispatch, _failed_try

    class Bar:
        done = 0

        def update(self, n):
            self.done += n

    tasks = [ShardTask(shard_id=i, input_path=Path(f"{i:05d}.tar"), output=None, state="new") for i in range(3)]
    state, summary, bar = _Dispatch(pending=deque(tasks)), JobSummary(), Bar()
    options = RayOptions(workers=2, shard_attempts=3)
    live = {0, 1}
    first = state.next_task(0, live)
    assert first.shard_id == 0
    _failed_try(first, 0, "worker 0 died", state, summary, options, bar)
    # worker 0 failed shard 0: it gets shard 1; worker 1 gets shard 0 back first
    assert state.next_task(0, live).shard_id == 1
    assert state.next_task(1, live).shard_id == 0
    _failed_try(first, 1, "worker 1 died", state, summary, options, bar)
    # every live worker has failed it now: any of them may try it again, and it is the last try
    assert state.next_task(0, live).shard_id == 0
    _failed_try(first, 0, "worker 0 died again", state, summary, options, bar)
    assert summary.failed == {0: "3 tries: worker 0 died; worker 1 died; worker 0 died again"}
    assert bar.done == 1 and [t.shard_id for t in state.pending] == [2]


def test_without_ray_the_error_names_the_install_line(monkeypatch):
    from demind.errors import MissingDependencyError
    from demind.distributed import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without Ray gives
    with pytest.raises(MissingDependencyError, match=r"pip install 'demind\[distributed\]'"):
        import_ray()
