"""A site runs at most ``max_concurrent_jobs`` jobs at once (fedpartial.flare.site_resources): the
count FLARE's scheduler meets when it asks the site's resource manager before starting a job."""
import json
from types import SimpleNamespace

import pytest
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext

from fedpartial.flare import site_resources
from fedpartial.flare.site_resources import JOB_SLOT, SiteResourceConsumer, SiteResourceManager


def _ctx(root) -> FLContext:
    """An FLContext whose engine's workspace is ``root`` (what participant_config reads)."""
    workspace = SimpleNamespace(get_root_dir=lambda: str(root))
    ctx = FLContext()
    ctx.set_prop(ReservedKey.ENGINE, SimpleNamespace(get_workspace=lambda: workspace), private=True, sticky=False)
    return ctx


def _site_file(root, **values):
    (root / "local").mkdir(exist_ok=True)
    (root / "local" / "fedpartial_site.json").write_text(json.dumps({"format_version": 1, "datasets": {}, **values}))


def _start(manager, ctx=None) -> dict:
    """What FLARE does for a job the site has room for: check (reserve), then allocate at its start."""
    ok, token = manager.check_resources({}, ctx)
    assert ok
    return manager.allocate_resources({}, token, ctx)


def test_a_site_starts_no_more_jobs_than_its_slots_and_frees_each_slot_once():
    manager = SiteResourceManager(max_concurrent_jobs=2)
    # a job checked but never started (its deployment failed: FLARE neither allocates nor cancels,
    # the reservation only expires) holds no slot
    assert manager.check_resources({}, None)[0] and manager.jobs_held == 0
    first = _start(manager)
    assert first == {JOB_SLOT: 1}  # not empty, so FLARE frees it when the job ends
    second = _start(manager)
    assert manager.jobs_held == 2 and manager.check_resources({}, None) == (False, "")  # the third waits
    manager.free_resources(first, "", None)  # the first job ends
    assert manager.jobs_held == 1 and manager.check_resources({}, None)[0]
    ok, token = manager.check_resources({}, None)
    manager.cancel_resources({}, token, None)  # the scheduler gave a reservation up: nothing held changes
    manager.free_resources({}, "", None)       # a record without a slot frees none
    assert manager.jobs_held == 1
    manager.free_resources(second, "", None)
    assert manager.jobs_held == 0


def test_the_count_comes_from_the_site_file_at_every_check(tmp_path):
    _site_file(tmp_path, max_concurrent_jobs=2)
    manager, ctx = SiteResourceManager(), _ctx(tmp_path)
    _start(manager, ctx), _start(manager, ctx)
    assert not manager.check_resources({}, ctx)[0]
    _site_file(tmp_path, max_concurrent_jobs=3)  # the site raises it; no restart
    _start(manager, ctx)
    assert not manager.check_resources({}, ctx)[0]
    assert manager.report_resources(ctx)["max_concurrent_jobs"] == 3
    _site_file(tmp_path, max_concurrent_jobs=0)
    with pytest.raises(ValueError, match=r"fedpartial_site.json'?: max_concurrent_jobs must be an integer >= 1"):
        manager.check_resources({}, ctx)
    with pytest.raises(ValueError, match="max_concurrent_jobs must be an integer >= 1, got 0"):
        SiteResourceManager(max_concurrent_jobs=0)


def test_the_default_is_one_job_at_a_time_without_a_site_file(tmp_path):
    manager = SiteResourceManager()
    _start(manager, _ctx(tmp_path))
    assert not manager.check_resources({}, _ctx(tmp_path))[0]


def test_gpus_are_counted_as_flares_manager_counts_them(monkeypatch):
    monkeypatch.setattr(site_resources.GPUResourceManager, "__init__", _two_gpus_of_8_gib)
    manager = SiteResourceManager(max_concurrent_jobs=4)
    ok, token = manager.check_resources({"num_of_gpus": 1, "mem_per_gpu_in_GiB": 6}, None)
    assert ok and manager.allocate_resources({}, token, None) == {0: 6, JOB_SLOT: 1}
    # GPU 0 has 2 GiB left, GPU 1 8: a job asking two GPUs of 6 waits although slots are free
    assert manager.check_resources({"num_of_gpus": 2, "mem_per_gpu_in_GiB": 6}, None) == (False, "")
    manager.free_resources({0: 6, JOB_SLOT: 1}, token, None)
    assert manager.resources[0].memory == 8 and manager.jobs_held == 0


def _two_gpus_of_8_gib(self, num_of_gpus, mem_per_gpu_in_GiB, expiration_period=30, **_):
    from nvflare.app_common.resource_managers.auto_clean_resource_manager import AutoCleanResourceManager
    from nvflare.app_common.resource_managers.gpu_resource_manager import GPUResource

    self.num_gpu_key, self.gpu_mem_key = "num_of_gpus", "mem_per_gpu_in_GiB"
    AutoCleanResourceManager.__init__(self, {i: GPUResource(i, 8) for i in range(2)}, expiration_period=30)


def test_the_consumer_gives_a_job_its_gpus_only(monkeypatch):
    seen = []
    monkeypatch.setattr(site_resources.GPUResourceConsumer, "consume", lambda self, r: seen.append(r))
    consumer = SiteResourceConsumer()
    consumer.consume({JOB_SLOT: 1})
    consumer.consume({1: 4.0, JOB_SLOT: 1})
    assert seen == [{1: 4.0}]  # a CPU job leaves CUDA_VISIBLE_DEVICES as it was
