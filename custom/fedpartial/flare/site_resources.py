"""A site's resource manager (``local/resources.json``): its GPUs as FLARE's own
``GPUResourceManager`` counts them, and at most ``max_concurrent_jobs`` jobs at once.

Every limit in ``fedpartial_site.json`` is checked per job, and the server starts up to its
``max_jobs`` (4) jobs at once at every site, so without a count four jobs at the limits ask four
times a site's memory. FLARE's scheduler asks each site's resource manager before it starts a job;
a site that has its jobs answers "not enough resources", and the job waits in the server's queue
(``SUBMITTED``) until the site has finished one, as a job asking for a busy GPU does. The count
lives here because FLARE frees a job's resources only when their record is not empty: every job's
record holds a slot (:data:`JOB_SLOT`) beside its GPUs. A slot is taken when the job starts, not when
the scheduler asks: FLARE's server deploys and starts one job before it asks for the next.
"""
from __future__ import annotations

from typing import Optional, Union

from nvflare.apis.fl_context import FLContext
from nvflare.app_common.resource_consumers.gpu_resource_consumer import GPUResourceConsumer
from nvflare.app_common.resource_managers.gpu_resource_manager import GPUResourceManager

from fedpartial.flare.site_config import LIMITS, participant_config, site_rules

#: the key of a job's slot in its resources (GPU ids are integers)
JOB_SLOT = "fedpartial_job_slot"


class SiteResourceManager(GPUResourceManager):
    """GPUs as :class:`GPUResourceManager`, plus a count of the jobs this site runs.

    Args:
        num_of_gpus / mem_per_gpu_in_GiB / expiration_period: as FLARE's ``GPUResourceManager``.
        max_concurrent_jobs: jobs at once; ``None`` (the default) takes ``max_concurrent_jobs`` of the
            site's ``local/fedpartial_site.json`` at every check, so the site changes it in one place.
    """

    def __init__(self, num_of_gpus: int = 0, mem_per_gpu_in_GiB: Union[int, float] = 0,
                 expiration_period: Union[int, float] = 30, max_concurrent_jobs: Optional[int] = None):
        super().__init__(num_of_gpus=num_of_gpus, mem_per_gpu_in_GiB=mem_per_gpu_in_GiB,
                         expiration_period=expiration_period)
        if max_concurrent_jobs is not None and (isinstance(max_concurrent_jobs, bool)
                                                or not isinstance(max_concurrent_jobs, int) or max_concurrent_jobs < 1):
            raise ValueError(f"SiteResourceManager max_concurrent_jobs must be an integer >= 1, got "
                             f"{max_concurrent_jobs!r}")
        self.max_concurrent_jobs = max_concurrent_jobs
        # running jobs only: FLARE's server starts one job at a time, and a job it failed to deploy
        # never frees its reservation (it only expires), which must not hold the site
        self.jobs_held = 0
        self._limit = max_concurrent_jobs or LIMITS["max_concurrent_jobs"]

    def check_resources(self, resource_requirement: dict, fl_ctx: FLContext):
        if self.max_concurrent_jobs is None:  # read before the base takes its lock
            self._limit = site_rules(participant_config(fl_ctx))["max_concurrent_jobs"]
        enough, token = super().check_resources(resource_requirement, fl_ctx)
        if not enough:
            self.log_info(fl_ctx, f"not starting another job: this site runs {self.jobs_held} of its "
                                  f"{self._limit} ('max_concurrent_jobs'), or lacks the GPUs asked for")
        return enough, token

    def _check_required_resource_available(self, resource_requirement: dict) -> bool:
        return self.jobs_held < self._limit and super()._check_required_resource_available(resource_requirement)

    def _reserve_resource(self, resource_requirement: dict) -> dict:
        return {**super()._reserve_resource(resource_requirement), JOB_SLOT: 1}

    def allocate_resources(self, resource_requirement: dict, token: str, fl_ctx: FLContext) -> dict:
        record = super().allocate_resources(resource_requirement, token, fl_ctx)
        with self._lock:
            self.jobs_held += 1
        return record

    def free_resources(self, resources: dict, token: str, fl_ctx: FLContext):
        super().free_resources(resources, token, fl_ctx)
        if resources.get(JOB_SLOT):
            with self._lock:
                self.jobs_held = max(0, self.jobs_held - 1)

    def _deallocate(self, resources: dict):
        super()._deallocate({k: v for k, v in resources.items() if k != JOB_SLOT})

    def _resource_to_dict(self) -> dict:
        return {**super()._resource_to_dict(), "jobs_held": self.jobs_held, "max_concurrent_jobs": self._limit}


class SiteResourceConsumer(GPUResourceConsumer):
    """FLARE's ``GPUResourceConsumer`` given a job's GPUs only (not its slot), and not at all when it
    has none, as FLARE does for an empty record."""

    def consume(self, resources: dict):
        gpus = {k: v for k, v in resources.items() if k != JOB_SLOT}
        if gpus:
            super().consume(gpus)
