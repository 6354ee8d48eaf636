"""What a provisioned kit lets a job without code do, and what a site installs (no running system):

* the component allow-list: exact classes of the runtime (``fedpartial.flare.allowed``), written in
  place of FLARE's default into every kit; every job a user can export uses only those, and the
  components an attacker would reach for (log streamer, peer-to-peer controllers, module
  functions, the test-only recorder) are refused by FLARE's own authorizer;
* logs stay at the site; shell commands only for admins of the site's own organisation;
* the runtime wheel's ``.sha256`` and the hashed site lock (``requirements-site.lock``).

Provisioning and the wheel take ~1 s each."""
import hashlib
import importlib
import inspect
import json
import re
import shutil
import subprocess
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_exception import UnsafeComponentError
from nvflare.app_common.widgets.component_path_authorizer import ComponentPathAuthorizer
from nvflare.fuel.sec.authz import AuthzContext, Person
from nvflare.security.security import FLAuthorizer

from fedpartial.flare.allowed import CLASS_ALLOW_LIST
from fedpartial.flare.site_policy import UPDATE_MASK_FILTER
from fedpartial_tools.deploy import provision
from fedpartial_tools.deploy.builders import JOB_LOG_STREAMER, SCHEDULE_TRIES, SITE_RESOURCES, SitePolicyBuilder

REPO = Path(__file__).resolve().parents[1]
SITE_ORGS = {"site-1": "hospital_a", "site-2": "hospital_b"}  # localhost_project's orgs
SERVER_ORG = "hospital_a"
# what an attacker's job would name: FLARE's log streamer and peer-to-peer controllers (all on FLARE's
# default list), runtime functions (admitted by a "fedpartial." prefix) and the test-only recorder
REFUSED = ["nvflare.app_common.logging.job_log_streamer.JobLogStreamer",
           "nvflare.app_common.logging.job_log_receiver.JobLogReceiver",
           "nvflare.app_common.ccwf.SwarmClientController",
           "nvflare.app_common.ccwf.swarm_server_ctl.SwarmServerController",
           "nvflare.app_common.ccwf.CyclicClientController",
           "nvflare.app_common.workflows.cyclic_ctl.CyclicController",
           "fedpartial.algorithms.registry.build_rule",
           "fedpartial.flare.common.build_rule",
           "fedpartial.flare.common.atomic_write_json",
           "fedpartial.flare.recorder.MessageRecorder"]


@pytest.fixture(scope="module")
def prod(tmp_path_factory):
    root = tmp_path_factory.mktemp("kit_policy")
    project = provision.localhost_project("kits", 18104, list(SITE_ORGS), site_policy={"allow_byoc": False})
    return Path(provision.provision(provision.write_project(str(root / "p.yml"), project), str(root / "ws"),
                                    env=provision.kit_env(str(root))))


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _authorize(resources: Path, path: str) -> None:
    """FLARE's component check of a job without code, against ``resources`` (raises if refused)."""
    workspace = SimpleNamespace(get_resources_file_path=lambda: str(resources))
    ComponentPathAuthorizer().authorize_component_config({"id": "c", "path": path}, workspace=workspace)


def _component_paths(config) -> list:
    """Every component path in a job config, nested ones (in ``args``) included, as FLARE walks it."""
    if isinstance(config, dict):
        if "path" in config or "class_path" in config:
            return [config.get("path") or config["class_path"]] + _component_paths(config.get("args"))
        config = list(config.values())
    if isinstance(config, list):
        return [p for item in config for p in _component_paths(item)]
    return []


def test_the_allow_list_names_classes_only():
    assert len(CLASS_ALLOW_LIST) == len(set(CLASS_ALLOW_LIST))
    for path in CLASS_ALLOW_LIST:
        module, name = path.rsplit(".", 1)
        obj = getattr(importlib.import_module(module), name)
        assert inspect.isclass(obj) and issubclass(obj, FLComponent), f"{path} is not an FLARE component class"
        assert obj.__module__ == module, f"{path} is imported there, not defined"
    assert not set(REFUSED) & set(CLASS_ALLOW_LIST)


def test_kits_carry_the_runtime_allow_list_in_place_of_flares(prod):
    for kit in ["localhost", *SITE_ORGS]:
        local = prod / kit / "local"
        written, default = _json(local / "resources.json"), _json(local / "resources.json.default")
        assert written["class_allow_list"] == list(CLASS_ALLOW_LIST), kit
        assert written["class_list_enforcement_mode"] == "enforce"
        assert len(default["class_allow_list"]) == 88  # FLARE's, kept beside it for comparison
        for path in CLASS_ALLOW_LIST:
            _authorize(local / "resources.json", path)
        for path in REFUSED:
            with pytest.raises(UnsafeComponentError, match=re.escape(f"Component '{path}'")):
                _authorize(local / "resources.json", path)
        # FLARE's default would have admitted the log streamer and the Swarm controller
        _authorize(local / "resources.json.default", REFUSED[0])
        _authorize(local / "resources.json.default", REFUSED[2])


def _exported_jobs(tmp_path: Path) -> list:
    """Every job folder a user can make with the repository's tooling: each recipe's every profile
    (``jobs --write`` exports the cpu ones), the shipped jobs/, and the privacy tool's filter variant."""
    from fedpartial_tools.bench.privacy import filter_chain, filter_settings
    from fedpartial_tools.jobs.packaging import package_job
    from fedpartial_tools.jobs.recipes import RECIPES, export_job

    jobs = [export_job(name, str(tmp_path / f"{name}-{profile}"), profile)
            for name, cls in RECIPES.items() for profile in cls.PROFILES]
    jobs += [str(p) for p in sorted((REPO / "jobs").iterdir()) if (p / "meta.json").is_file()]
    overrides = filter_settings(filter_chain("fedlsm", 5, {"class_counts": 1.0}), percentile=10)
    jobs.append(package_job(str(REPO / "jobs" / "fedlsm"), str(tmp_path / "privacy"), overrides, with_code=False))
    return jobs


def test_every_exported_job_and_the_privacy_policy_name_allowed_components_only(prod, tmp_path):
    used = set()
    for job in _exported_jobs(tmp_path):
        configs = sorted(Path(job).glob("*/config/config_fed_*.json"))
        assert len(configs) == 2, job
        for config in configs:
            kit = "localhost" if config.name == "config_fed_server.json" else "site-1"
            for path in _component_paths(_json(config)):
                _authorize(prod / kit / "local" / "resources.json", path)  # raises naming the path if refused
                used.add(path)
    privacy = _json(REPO / "provisioning" / "privacy.json")
    used |= set(_component_paths(privacy["scopes"])) | set(_component_paths(privacy["components"]))
    used.add(UPDATE_MASK_FILTER["path"])  # the filter DEPLOYMENT §6 tells a site to add
    # nothing on the list that no job, variant or site policy uses
    assert used == set(CLASS_ALLOW_LIST), sorted(used ^ set(CLASS_ALLOW_LIST))


def test_job_logs_stay_at_the_site(prod):
    def paths(resources):
        return [c["path"] for c in resources["components"]]

    for site in SITE_ORGS:
        local = prod / site / "local"
        written, default = _json(local / "resources.json"), _json(local / "resources.json.default")
        assert default["allow_log_streaming"] is True and written["allow_log_streaming"] is False
        assert "nvflare.app_common.logging.site_log_streamer.SiteLogStreamer" in paths(default)
        # FLARE's GPU manager and consumer swapped for the site's, which also counts its jobs
        assert paths(written) == [SITE_RESOURCES.get(p, p) for p in paths(default)
                                  if not p.endswith(".SiteLogStreamer")] and len(paths(written)) == 3
        assert {"fedpartial.flare.site_resources.SiteResourceManager",
                "fedpartial.flare.site_resources.SiteResourceConsumer"} <= set(paths(written))
    # nor does the server keep a receiver for logs of sites whose kit still streams
    local = prod / "localhost" / "local"
    scheduler = [c for c in _json(local / "resources.json")["components"] if c["id"] == "job_scheduler"]
    assert scheduler[0]["args"] == {"max_jobs": 4, "max_schedule_count": SCHEDULE_TRIES}  # a queued job waits days
    assert REFUSED[1] in paths(_json(local / "resources.json.default"))  # FLARE's JobLogReceiver
    assert not [p for p in paths(_json(local / "resources.json")) if "logging" in p]


def _may(policy: dict, site_org: str, role: str, user_org: str, right: str) -> bool:
    user = Person("u@x.org", user_org, role)
    return FLAuthorizer(site_org, policy).authorize(AuthzContext(right=right, user=user, submitter=user))[0]


def test_shell_commands_only_for_the_sites_own_organisation(prod):
    shell = ["ls", "cat", "head", "tail", "grep", "pwd"]
    for kit, org in [("localhost", SERVER_ORG), *SITE_ORGS.items()]:
        written = _json(prod / kit / "local" / "authorization.json")
        default = _json(prod / kit / "local" / "authorization.json.default")
        rights = written["permissions"]
        assert {role: r["shell_commands"] for role, r in rights.items()} == \
            {"project_admin": "o:site", "org_admin": "o:site", "lead": "o:site", "member": "none"}, kit
        assert not [(role, c) for role, r in rights.items() for c in shell if c in r]  # no per-command override
        other = "hospital_b" if org == "hospital_a" else "hospital_a"
        for command in shell:
            for role in ("project_admin", "org_admin", "lead"):
                assert _may(written, org, role, org, command), (kit, role, command)
                assert not _may(written, org, role, other, command), (kit, role, command)
            assert not _may(written, org, "member", org, command)
            # FLARE's default gives a project admin of any organisation every site's shell
            assert _may(default, org, "project_admin", other, command)
        assert _may(written, org, "project_admin", other, "submit_job")  # the rest unchanged


def test_a_jobs_error_lines_only_for_the_sites_own_organisation(prod):
    """show_errors returns the ERROR lines a job logged at a site (data paths, class lists); by
    FLARE's default every role with 'view' reads them at every site."""
    for kit, org in [("localhost", SERVER_ORG), *SITE_ORGS.items()]:
        written = _json(prod / kit / "local" / "authorization.json")
        default = _json(prod / kit / "local" / "authorization.json.default")
        other = "hospital_b" if org == "hospital_a" else "hospital_a"
        for command in ("show_errors", "reset_errors"):
            for role in ("project_admin", "org_admin", "lead", "member"):
                assert _may(written, org, role, org, command), (kit, role, command)
                assert not _may(written, org, role, other, command), (kit, role, command)
                assert _may(default, org, role, other, command), (kit, role, command)
        assert _may(written, org, "lead", other, "show_stats")  # the rest of 'view' unchanged


def test_log_streaming_and_prefixes_are_explicit_opt_ins(prod):
    site_default = _json(prod / "site-1" / "local" / "resources.json.default")
    server_default = _json(prod / "localhost" / "local" / "resources.json.default")
    builder = SitePolicyBuilder(allow_log_streaming=True, class_prefixes=["fedpartial.flare."])
    site = builder.resources(site_default, site=True)
    assert site["allow_log_streaming"] is True and site["components"] == [
        dict(c, path=SITE_RESOURCES.get(c["path"], c["path"])) for c in site_default["components"]]
    # the job log streamer the site's streamer adds to every job must pass the site's allow-list
    assert site["class_allow_list"] == list(CLASS_ALLOW_LIST) + ["fedpartial.flare.", JOB_LOG_STREAMER]
    server = builder.resources(server_default, site=False)
    # the server adds only its check of a job's meta at submission, and queues a job for days
    assert server["components"] == [
        dict(c, args={**c["args"], "max_schedule_count": SCHEDULE_TRIES}) if c["id"] == "job_scheduler" else c
        for c in server_default["components"]] + [
        {"id": "submission_gate", "path": "fedpartial.flare.job_gate.SubmissionGate", "args": {}}]
    assert server["class_allow_list"] == list(CLASS_ALLOW_LIST) + ["fedpartial.flare."]
    for bad, match in [({"class_allow_list": ["fedpartial."]}, "class_allow_list entry 'fedpartial.' must be an "
                                                               "exact dotted class path"),
                       ({"class_allow_list": "fedpartial.flare.executors.FedPartialExecutor"},
                        "class_allow_list must be a list of class paths"),
                       ({"class_prefixes": ["fedpartial.flare.executors.FedPartialExecutor"]},
                        "class_prefixes entry 'fedpartial.flare.executors.FedPartialExecutor' must be a package "
                        "prefix ending in '.'"),
                       ({"allow_log_streaming": "no"}, "allow_log_streaming must be true or false, got 'no'")]:
        with pytest.raises(ValueError, match=re.escape(match)):
            SitePolicyBuilder(**bad)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_runtime_wheel_comes_with_its_lock_and_checked_sha256(tmp_path):
    wheel = Path(provision.build_runtime(str(tmp_path / "a")))
    lock = wheel.parent / "requirements-site.lock"
    cuda = wheel.parent / "requirements-site-cuda.lock"
    assert lock.read_bytes() == (REPO / "requirements-site.lock").read_bytes()
    assert cuda.read_bytes() == (REPO / "requirements-site-cuda.lock").read_bytes()
    sums = Path(f"{wheel}.sha256")
    assert sums.read_text() == (f"{_sha256(wheel)}  {wheel.name}\n{_sha256(lock)}  requirements-site.lock\n"
                                f"{_sha256(cuda)}  requirements-site-cuda.lock\n")
    if shutil.which("sha256sum"):  # the format sites check with
        subprocess.run(["sha256sum", "-c", "--quiet", sums.name], cwd=wheel.parent, check=True)
    assert provision.verify_runtime(str(wheel)) == [str(wheel), str(lock), str(cuda)]
    # the same source builds the same wheel, whenever its files were checked out
    assert {i.date_time for i in zipfile.ZipFile(wheel).infolist()} == {(1980, 1, 1, 0, 0, 0)}
    assert _sha256(Path(provision.build_runtime(str(tmp_path / "b")))) == _sha256(wheel)
    original = wheel.read_bytes()
    for tampered in (wheel, lock, cuda):
        saved = tampered.read_bytes()
        tampered.write_bytes(saved + b"\n")
        with pytest.raises(ValueError, match=re.escape(f"'{tampered}' has sha256 {_sha256(tampered)}, but '{sums}'")):
            provision.verify_runtime(str(wheel))
        tampered.write_bytes(saved)
    assert wheel.read_bytes() == original
    sums.write_text(f"{_sha256(lock)}  requirements-site.lock\n")
    with pytest.raises(ValueError, match=re.escape(f"'{sums}' has no line for '{wheel.name}'")):
        provision.verify_runtime(str(wheel))


def _lock_entries(text: str) -> dict:
    """``{name: (version, [sha256 ...])}`` of a lock, parsed independently of the tooling."""
    entries = {}
    for logical in text.replace("\\\n", " ").splitlines():
        if not logical.strip() or logical.lstrip().startswith("#"):
            continue
        spec, *options = logical.split()
        name, version = spec.split("==")
        hashes = [re.fullmatch(r"--hash=sha256:([0-9a-f]{64})", o).group(1) for o in options]
        assert hashes, f"{spec} has no hash"
        entries[re.sub(r"[-_.]+", "-", name).lower()] = (version, hashes)
    return entries


def test_the_site_lock_pins_every_package_with_its_hash():
    from importlib import metadata

    from packaging.requirements import Requirement

    entries = _lock_entries((REPO / "requirements-site.lock").read_text())
    assert len(entries) == len(provision.check_site_lock(str(REPO / "requirements-site.lock"))) > 50
    pins = dict(line.strip().split("==") for line in (REPO / "requirements.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    for name in ("torch", "nvflare", "monai", "numpy", "scikit-learn", "tensorboard"):
        assert entries[name][0].split("+")[0] == pins[name], name
    assert entries["torch"][0] == "2.13.0+cpu"  # the CPU build this machine resolves
    assert not {"pydicom", "nibabel", "matplotlib", "pytest"} & set(entries)  # tooling / tests: not at sites
    # transitive: what each locked package needs (as installed here at the same version) is locked too
    checked = 0
    for name, (version, _) in entries.items():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if dist.version != version:
            continue
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                assert re.sub(r"[-_.]+", "-", req.name).lower() in entries, f"{name} needs {req.name}: not locked"
        checked += 1
    assert checked > 40


def test_site_lock_text_from_pips_report(tmp_path):
    digest = "ab" * 32
    report = {"environment": {"implementation_name": "cpython", "python_version": "3.11", "sys_platform": "linux",
                              "platform_machine": "x86_64"},
              "install": [{"metadata": {"name": "torch", "version": "2.13.0+cpu"},
                           "download_info": {"url": "file:///w/torch-2.13.0%2Bcpu-cp311-cp311-linux_x86_64.whl",
                                             "archive_info": {"hashes": {"sha256": digest}}}},
                          {"metadata": {"name": "Flask", "version": "3.1.3"},
                           "download_info": {"url": "https://files/flask-3.1.3-py3-none-any.whl",
                                             "archive_info": {"hash": f"sha256={'cd' * 32}"}}}]}
    text = provision.site_lock_text(report, ["torch==2.13.0"], "a test")
    assert text.endswith(f"Flask==3.1.3 \\\n    --hash=sha256:{'cd' * 32}\n"
                         f"torch==2.13.0+cpu \\\n    --hash=sha256:{digest}\n")
    assert "# Resolved by pip for cpython 3.11 on linux x86_64" in text
    assert "#   torch==2.13.0+cpu: torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl, not on PyPI" in text
    lock = tmp_path / "site.lock"
    lock.write_text(text)
    assert provision.check_site_lock(str(lock)) == ["Flask==3.1.3", "torch==2.13.0+cpu"]
    lock.write_text(text + "numpy==2.4.6\n")
    with pytest.raises(ValueError, match=re.escape(f"site lock '{lock}': requirement 'numpy==2.4.6' must be "
                                                   f"pinned with == and carry only --hash=sha256")):
        provision.check_site_lock(str(lock))
    del report["install"][1]["download_info"]["archive_info"]["hash"]
    with pytest.raises(ValueError, match=re.escape("pip report: no sha256 for Flask==3.1.3")):
        provision.site_lock_text(report, [], "a test")


def test_each_kit_holds_its_floors_limits_weighting_and_statistics_and_the_server_waits_for_every_site(prod):
    """The server's file: every site of the project behind a published aggregate (2 here; with
    different subsets of one round's local models, jobs are equations in them), its submission limits
    and how it weights; a site's: its weighting and limits, no server keys."""
    from fedpartial.flare.site_config import (LIMITS, SERVER_STATISTICS, SERVER_WEIGHTING, SITE_STATISTICS,
                                              SITE_WEIGHTING, SUBMISSION_LIMITS)

    server = _json(prod / "localhost" / "local" / "fedpartial_site.json")
    assert server["min_sites_per_round"] == len(SITE_ORGS) and server["weighting"] == SERVER_WEIGHTING
    assert server["statistics"] == SERVER_STATISTICS and "min_local_steps" not in server
    assert {k: server[k] for k in SUBMISSION_LIMITS} == SUBMISSION_LIMITS
    for site in SITE_ORGS:
        own = _json(prod / site / "local" / "fedpartial_site.json")
        assert own["weighting"] == SITE_WEIGHTING and own["statistics"] == SITE_STATISTICS
        assert own["min_count"] == 5 and own["min_local_steps"] == 2 and own["min_adam_beta2"] == 0.9 \
            and own["max_weight_decay"] == 0.01
        assert {k: own[k] for k in LIMITS} == LIMITS and not set(SUBMISSION_LIMITS) & set(own)
        assert "min_sites_per_round" not in own


@pytest.mark.parametrize("setting, expected", [("all", 7), (3, 3)])
def test_the_servers_floor_of_sites_is_every_site_unless_the_consortium_lowers_it(setting, expected):
    from types import SimpleNamespace as NS

    builder = SitePolicyBuilder(min_sites_per_round=setting)
    config = builder.site_config(NS(name="server", get_prop=lambda k: None), site=False, num_sites=7)
    assert config["min_sites_per_round"] == expected
    for bad in (1, "some", True):
        with pytest.raises(ValueError, match="min_sites_per_round must be \"all\" or an integer >= 2"):
            SitePolicyBuilder(min_sites_per_round=bad)
