"""A site's secret rescaling of its update (fedpartial.algorithms.update_mask) and its scope filter
(fedpartial.flare.site_policy.UpdateMask): what the lead's sign decoder reads with and without it."""
from types import SimpleNamespace

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext

from fedpartial.algorithms.update_mask import mask_factors, masked_diff, masked_weights, model_digest
from fedpartial.flare.site_policy import UPDATE_MASK_FILTER, UpdateMask
from fedpartial_tools.bench.sign_decoding import decode_two_sites


@pytest.fixture(autouse=True)
def _fresh_jobs():
    """Each test's jobs are new to the filter (a real job id is unique; these tests reuse ids)."""
    UpdateMask.first_model.clear()
    yield
    UpdateMask.first_model.clear()


def test_factors_are_the_sites_own_fixed_and_centred_on_one():
    f = mask_factors(b"site-1 key", "fc.weight", (200, 50), 1.0)
    assert f.shape == (200, 50) and f.min() >= 0.0 and f.max() <= 2.0
    assert abs(f.mean() - 1.0) < 0.02 and f.std() > 0.5  # uniform on [0, 2]: std 0.577
    np.testing.assert_array_equal(f, mask_factors(b"site-1 key", "fc.weight", (200, 50), 1.0))  # every round
    assert not np.allclose(f, mask_factors(b"site-2 key", "fc.weight", (200, 50), 1.0))  # another site's
    assert not np.allclose(f, mask_factors(b"site-1 key", "fc.bias", (200, 50), 1.0))  # another parameter's
    half = mask_factors(b"site-1 key", "fc.weight", (200, 50), 0.25)
    assert half.min() >= 0.75 and half.max() <= 1.25
    np.testing.assert_array_equal(mask_factors(b"k", "w", (3,), 0.0), np.ones(3))
    with pytest.raises(ValueError, match="spread"):
        mask_factors(b"k", "w", (3,), 1.5)


def test_the_mask_rescales_each_weights_update_and_leaves_counters_and_statistics():
    received = {"w": np.array([1.0, 1.0, 1.0], np.float32), "steps": np.array(7), "bn.running_var": np.ones(2)}
    local = {"w": np.array([3.0, 1.0, -1.0], np.float32), "steps": np.array(9), "bn.running_var": np.full(2, 0.1)}
    f = mask_factors(b"k", "w", (3,), 0.5)
    sent = masked_weights(received, local, b"k", 0.5)
    # received + f x (local - received): updates 2, 0, -2
    np.testing.assert_allclose(sent["w"], [1 + 2 * f[0], 1.0, 1 - 2 * f[2]], rtol=1e-6)
    assert sent["w"].dtype == np.float32 and sent["steps"] == 9
    # a running variance is a statistic, not a step: rescaled by up to 2 it could turn negative
    np.testing.assert_array_equal(sent["bn.running_var"], [0.1, 0.1])
    np.testing.assert_allclose(masked_diff({"w": local["w"] - received["w"]}, b"k", 0.5)["w"], sent["w"] - 1,
                               rtol=1e-6)
    with pytest.raises(ValueError, match="'w'"):
        masked_weights({"w": np.ones(2)}, local, b"k", 0.5)


def test_the_lead_no_longer_reads_the_light_sites_signs_in_the_sign_regime():
    """Updates of exactly +-1 per weight (the tiny-lr regime), weights 0.2 / 0.8: the decoder reads
    every sign of the light site from the plain average, and about what the average's own sign
    says (half) from the masked one."""
    rng = np.random.default_rng(0)
    light, heavy = rng.choice([-1.0, 1.0], 20_000), rng.choice([-1.0, 1.0], 20_000)

    def decoded(a, b):
        _, signs_light = decode_two_sites(0.2 * a + 0.8 * b)
        return float(np.mean(signs_light == light))

    assert decoded(light, heavy) == 1.0
    masked = [masked_diff({"w": u}, key, 1.0)["w"] for u, key in ((light, b"site-1"), (heavy, b"site-2"))]
    assert decoded(*masked) < 0.65


class _Workspace(SimpleNamespace):
    def get_root_dir(self):
        return self.root


def _ctx(root, direction, task_id="t-1", carry=None):
    ctx = carry or FLContext()
    engine = SimpleNamespace(get_workspace=lambda: _Workspace(root=str(root)), fire_event=lambda *a: None)
    ctx.get_engine = lambda: engine
    ctx.set_prop(FLContextKey.TASK_ID, task_id, private=True, sticky=False)
    if direction:
        ctx.set_prop(FLContextKey.FILTER_DIRECTION, direction, private=True, sticky=False)
    return ctx


def test_the_scope_filter_masks_against_the_model_the_task_brought_and_fails_closed(tmp_path):
    (tmp_path / "startup").mkdir()
    (tmp_path / "startup" / "client.key").write_bytes(b"-----BEGIN PRIVATE KEY----- site-1")
    received = {"w": np.zeros(4, np.float32)}
    local = {"w": np.array([1.0, -1.0, 1.0, -1.0], np.float32)}
    expected = masked_weights(received, local, (tmp_path / "startup" / "client.key").read_bytes(), 1.0,
                              model_digest(received))["w"]
    mask = UpdateMask(spread=1.0)
    ctx = _ctx(tmp_path, "in")
    mask.process(DXO(DataKind.WEIGHTS, data=received).to_shareable(), ctx)
    out = mask.process(DXO(DataKind.WEIGHTS, data=local).to_shareable(), _ctx(tmp_path, "out", carry=ctx))
    np.testing.assert_allclose(from_shareable(out).data["w"], expected)
    assert not np.allclose(expected, local["w"])
    diff = mask.process(DXO(DataKind.WEIGHT_DIFF, data=local).to_shareable(), _ctx(tmp_path, "out"))
    np.testing.assert_allclose(from_shareable(diff).data["w"], expected)
    # weights of a task that brought no model (no data half, or another task's): withheld, not sent plain
    alone = mask.process(DXO(DataKind.WEIGHTS, data=local).to_shareable(), _ctx(tmp_path, "out"))
    assert alone.get_return_code() == ReturnCode.EMPTY_RESULT
    ctx = _ctx(tmp_path, "in", task_id="t-0")
    mask.process(DXO(DataKind.WEIGHTS, data=received).to_shareable(), ctx)
    other = mask.process(DXO(DataKind.WEIGHTS, data=local).to_shareable(), _ctx(tmp_path, "out", carry=ctx))
    assert other.get_return_code() == ReturnCode.EMPTY_RESULT
    # no key: withheld; metrics pass untouched
    keyless = UpdateMask(key_file="startup/none.key").process(DXO(DataKind.WEIGHT_DIFF, data=local).to_shareable(),
                                                               _ctx(tmp_path, "out"))
    assert keyless.get_return_code() == ReturnCode.EMPTY_RESULT
    metrics = DXO(DataKind.METRICS, data={"auc": 0.7}).to_shareable()
    assert mask.process(metrics, _ctx(tmp_path, "out")) is metrics
    for bad in ({"spread": 2}, {"spread": True}, {"key_file": ""}):
        with pytest.raises(ValueError, match="UpdateMask"):
            UpdateMask(**bad)


def test_factors_follow_the_jobs_first_model_fixed_through_its_rounds(tmp_path):
    """The same factors under another seed's signs show, per weight, whether two sites agree (an
    outside attempt: 0.67 of the light site's signs from 8 seeds): a job from another round-0 model
    gets other factors; a job from the same model, and every round of a job, the same."""
    (tmp_path / "startup").mkdir()
    (tmp_path / "startup" / "client.key").write_bytes(b"site-1 private key")
    update = {"w": np.ones(1000, np.float32)}

    def factors(mask, job, received):
        task = f"{job}-{len(UpdateMask.first_model)}"
        ctx = _ctx(tmp_path, "in", task_id=task)
        ctx.get_job_id = lambda: job
        mask.process(DXO(DataKind.WEIGHTS, data=received).to_shareable(), ctx)
        out = _ctx(tmp_path, "out", task_id=task, carry=ctx)
        out.get_job_id = lambda: job
        return from_shareable(mask.process(DXO(DataKind.WEIGHT_DIFF, data=update).to_shareable(), out)).data["w"]

    seed0, seed1 = {"w": np.zeros(1000, np.float32)}, {"w": np.full(1000, 0.5, np.float32)}
    mask = UpdateMask()
    first = factors(mask, "job-a", seed0)
    np.testing.assert_allclose(first, mask_factors(b"site-1 private key", "w", (1000,), 1.0, model_digest(seed0)),
                               rtol=1e-6)
    np.testing.assert_array_equal(factors(mask, "job-a", seed1), first)  # a later round of the same job
    np.testing.assert_array_equal(factors(UpdateMask(), "job-b", seed0), first)  # a job from the same model
    assert np.corrcoef(factors(mask, "job-c", seed1), first)[0, 1] < 0.1  # from another round-0 model
    # a result of a job that brought the site no model: withheld
    out = _ctx(tmp_path, "out")
    out.get_job_id = lambda: "job-d"
    assert mask.process(DXO(DataKind.WEIGHT_DIFF, data=update).to_shareable(), out).get_return_code() \
        == ReturnCode.EMPTY_RESULT
    # a first task that returns no weights (a validation of model seed0) does not pick the factors:
    # a second workflow's training from another model would otherwise reuse them under new signs
    ctx = _ctx(tmp_path, "in", task_id="validate-1")
    ctx.get_job_id = lambda: "job-e"
    mask.process(DXO(DataKind.WEIGHTS, data=seed0).to_shareable(), ctx)
    metrics = DXO(DataKind.METRICS, data={"auc": 0.7}).to_shareable()
    assert mask.process(metrics, _ctx(tmp_path, "out", carry=ctx)) is metrics
    np.testing.assert_array_equal(factors(mask, "job-e", seed1), factors(mask, "job-c", seed1))


def test_a_site_adds_the_mask_to_its_scope_and_flare_applies_it_last(tmp_path):
    """The shipped privacy.json with UPDATE_MASK_FILTER appended to both chains of its default scope
    (the snippet of DEPLOYMENT §6), built by FLARE's own parser and run as FLARE's client runner runs a task."""
    import json
    import shutil
    from pathlib import Path

    from nvflare.apis.utils.task_utils import apply_filters
    from nvflare.apis.workspace import Workspace
    from nvflare.private.fed.app.fl_conf import create_privacy_manager
    from nvflare.private.privacy_manager import Scope

    policy = json.loads((Path(__file__).resolve().parents[1] / "provisioning" / "privacy.json").read_text())
    default = next(s for s in policy["scopes"] if s["name"] == policy["default_scope"])
    for chain in ("task_data_filters", "task_result_filters"):
        default[chain].append(UPDATE_MASK_FILTER)
    for folder in ("local", "startup"):
        (tmp_path / folder).mkdir()
    (tmp_path / "local" / "privacy.json").write_text(json.dumps(policy))
    (tmp_path / "startup" / "client.key").write_bytes(b"site-1 private key")
    scope = create_privacy_manager(Workspace(str(tmp_path), "site-1"), names_only=False).get_scope(None)
    assert [type(f).__name__ for f in scope.task_result_filters["out"]] == ["LocalModelGate", "SiteResultPolicy",
                                                                           "UpdateMask"]
    received = {"w": np.zeros(6, np.float32)}
    local = {"w": np.linspace(-1, 1, 6).astype(np.float32)}
    result = DXO(DataKind.WEIGHTS, data=local)
    result.set_meta_prop("NUM_STEPS_CURRENT_ROUND", 40)
    ctx = _ctx(tmp_path, None)
    ctx.set_prop(FLContextKey.SCOPE_OBJECT, scope, private=True, sticky=False)
    ctx.set_prop(FLContextKey.TASK_NAME, "train", private=True, sticky=False)
    apply_filters(Scope.TASK_DATA_FILTERS_NAME, DXO(DataKind.WEIGHTS, data=received).to_shareable(), ctx, {},
                  "train", "in")
    out = apply_filters(Scope.TASK_RESULT_FILTERS_NAME, result.to_shareable(), ctx, {}, "train", "out")
    np.testing.assert_allclose(from_shareable(out).data["w"],
                               masked_weights(received, local, b"site-1 private key", 1.0, model_digest(received))["w"],
                               rtol=1e-6)
    shutil.rmtree(tmp_path / "startup")  # no key: the weights stay at the site
    ctx.set_prop(FLContextKey.TASK_ID, "t-2", private=True, sticky=False)
    apply_filters(Scope.TASK_DATA_FILTERS_NAME, DXO(DataKind.WEIGHTS, data=received).to_shareable(), ctx, {},
                  "train", "in")
    out = apply_filters(Scope.TASK_RESULT_FILTERS_NAME, result.to_shareable(), ctx, {}, "train", "out")
    assert out.get_return_code() == ReturnCode.EMPTY_RESULT


def test_deployment_shows_the_filter_a_site_adds():
    import json
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "DEPLOYMENT.md").read_text()
    assert json.dumps(UPDATE_MASK_FILTER) in text


def test_the_decay_oracle_divides_the_factor_sums_out_by_hand():
    """Two sites weighted 0.2 / 0.8, factors f1 = (0.5, 1.5, 1, 2), f2 = (1, 1, 0.5, 0.25): a decay job
    gives w1 f1 + w2 f2 = (0.9, 1.1, 0.6, 0.6) times each round-0 weight's sign; where the data job's
    |aggregate| reaches that sum the sites agree, below it they disagree. The last weight is misread:
    there the light site's weighted factor (0.4) exceeds the heavy site's (0.2), so the aggregate's
    sign is the light site's, not the heavy one's the decoder assumes."""
    from fedpartial_tools.bench.mask_oracles import decay_oracle

    theta_sign = np.array([1.0, -1.0, 1.0, -1.0])
    decay = np.array([0.9, -1.1, 0.6, -0.6])
    light, heavy = np.array([1.0, 1.0, -1.0, 1.0]), np.array([1.0, -1.0, -1.0, -1.0])
    f1, f2 = np.array([0.5, 1.5, 1.0, 2.0]), np.array([1.0, 1.0, 0.5, 0.25])
    data = 0.2 * f1 * light + 0.8 * f2 * heavy  # 0.9, -0.5, -0.6, 0.2
    np.testing.assert_allclose(data, [0.9, -0.5, -0.6, 0.2])
    np.testing.assert_array_equal(decay_oracle(data, decay, theta_sign), [1.0, 1.0, -1.0, -1.0])


def test_levels_across_seeds_read_the_light_site_only_while_the_factors_stay():
    """The same factors under other signs put |aggregate| on two levels per weight (the sites agree
    or not); factors drawn afresh per job blur them."""
    from fedpartial_tools.bench.mask_oracles import across_seed_levels

    rng = np.random.default_rng(1)
    jobs, size = 8, 5000
    light, heavy = rng.choice([-1.0, 1.0], (jobs, size)), rng.choice([-1.0, 1.0], (jobs, size))
    fixed = [rng.uniform(0, 2, size), rng.uniform(0, 2, size)]
    same = 0.2 * fixed[0] * light + 0.8 * fixed[1] * heavy
    fresh = 0.2 * rng.uniform(0, 2, (jobs, size)) * light + 0.8 * rng.uniform(0, 2, (jobs, size)) * heavy
    assert np.mean(across_seed_levels(same)[1] == light) > 0.85
    assert np.mean(across_seed_levels(fresh)[1] == light) < 0.62
