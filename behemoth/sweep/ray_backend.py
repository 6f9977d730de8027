"""sweep.backend=ray: each trial segment a Ray task asking for its processes' CPUs (and GPUs), placed by Ray's own
scheduler on a running cluster (sweep.ray.address) or on a local instance of a bounded number of CPUs. The sweep directory must
be on a file system every node sees: a trial's run directory is where its checkpoints live between rungs."""

from __future__ import annotations

import os
from typing import Any

from behemoth.errors import BehemothError
from behemoth.sweep.executors import Job, Outcome, Segment
from behemoth.sweep.spec import RaySpec


def connect(spec: RaySpec) -> Any:
    """ray, initialized: the cluster at spec.address, or a local instance of spec.num_cpus CPUs without a dashboard.
    (Ray 2.60 cannot bind a local instance to the loopback: ray.init turns 127.0.0.1 into the host's address and its gRPC
    servers listen on every interface, behind the token authentication Ray turns on by default.)"""
    try:
        import ray
    except ImportError:
        raise BehemothError("sweep.backend=ray needs Ray", "pip install 'behemoth[ray]' (or ray), or use sweep.backend=local") from None
    env = {"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}}
    if spec.address:
        ray.init(address=spec.address, runtime_env=env, log_to_driver=False)
    else:
        cpus = spec.num_cpus or len(os.sched_getaffinity(0))
        ray.init(num_cpus=cpus, include_dashboard=False, runtime_env=env, log_to_driver=False)
    return ray


class RayTasks:
    """Trial segments as Ray tasks: at most `capacity` in flight (default: as many as the cluster's CPUs hold)."""

    def __init__(self, spec: RaySpec, nproc: int, concurrency: int | None, segment: Segment) -> None:
        self.ray = connect(spec)
        resources = self.ray.cluster_resources()
        gpus = int(resources.get("GPU", 0))
        self.task = self.ray.remote(num_cpus=nproc, num_gpus=nproc if gpus else 0, max_retries=0)(segment)
        held = (gpus if gpus else int(resources.get("CPU", 1))) // nproc
        if held < 1:
            raise BehemothError(
                f"the Ray cluster has {int(resources.get('CPU', 0))} CPUs and {gpus} GPUs: no room for a {nproc}-process trial",
                "lower --nproc or connect to a larger cluster (sweep.ray.address)",
            )
        self.capacity = min(concurrency or held, held)
        self.flight: dict[Any, Job] = {}

    def submit(self, job: Job) -> None:
        self.flight[self.task.remote(job)] = job

    def wait(self) -> tuple[Job, Outcome]:
        """The next task to finish; a task Ray could not run (its worker died) ends as a failed segment."""
        (ref,), _ = self.ray.wait(list(self.flight), num_returns=1)
        job = self.flight.pop(ref)
        try:
            return job, self.ray.get(ref)
        except Exception as err:  # noqa: BLE001 - Ray's task errors (a dead worker, an unpicklable result) fail the segment
            first = (str(err).strip().splitlines() or [""])[0][:200]
            return job, {"rc": 1, "error": f"Ray task failed: {err.__class__.__name__}: {first}", "wall_s": 0.0}

    def close(self) -> None:
        for ref in self.flight:
            self.ray.cancel(ref, force=True)
        self.ray.shutdown()
