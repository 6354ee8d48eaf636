"""The installed-runtime path without a running system: the runtime wheel, jobs packaged without
code, the runtime-version check, the provisioned site policy (SitePolicyBuilder) and the
container outputs of provisioning. Each test provisions or builds in its own tmp dir (~1-2 s)."""
import json
import re
import zipfile
from pathlib import Path
from unittest import mock

import pytest
import yaml
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.fuel.sec.authz import AuthzContext, Person
from nvflare.security.security import FLAuthorizer

import fedpartial
from fedpartial.flare.common import runtime_identity
from fedpartial_tools.deploy import provision
from fedpartial_tools.jobs.packaging import package_job

REPO = Path(__file__).resolve().parents[1]
VERSION = fedpartial.__version__
IDENTITY = runtime_identity()  # version + content hash: what packaged jobs name


def test_runtime_wheel_holds_the_runtime_package_only(tmp_path):
    wheel = Path(provision.build_runtime(str(tmp_path)))
    assert wheel.name == f"fedpartial_runtime-{VERSION}-py3-none-any.whl"
    names = zipfile.ZipFile(wheel).namelist()
    code = [n for n in names if not n.startswith(f"fedpartial_runtime-{VERSION}.dist-info/")]
    assert code and all(n.startswith("fedpartial/") for n in code), code
    assert "fedpartial/flare/executors.py" in code and "fedpartial/__main__.py" not in code
    assert not [n for n in names if n.endswith(".pyc")]
    meta = zipfile.ZipFile(wheel).read(f"fedpartial_runtime-{VERSION}.dist-info/METADATA").decode()
    assert f"\nVersion: {VERSION}\n" in meta and "Requires-Dist: nvflare<2.10,>=2.9" in meta
    # one version source: pyproject reads fedpartial.__version__
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'version = {attr = "fedpartial.__version__"}' in pyproject


@pytest.mark.parametrize("with_code", [False, True])
def test_packaged_jobs_name_the_runtime_version(tmp_path, with_code):
    job = Path(package_job(str(REPO / "jobs" / "fedlsm"), str(tmp_path / "job"), with_code=with_code))
    assert (job / "app" / "custom").is_dir() == with_code
    client = json.loads((job / "app" / "config" / "config_fed_client.json").read_text())
    server = json.loads((job / "app" / "config" / "config_fed_server.json").read_text())
    assert client["executors"][0]["executor"]["args"]["runtime_version"] == IDENTITY
    versions = {c["path"]: c["args"].get("runtime_version") for c in server["components"]}
    assert versions["fedpartial.flare.persistor.FedPartialPersistor"] == IDENTITY
    assert versions["fedpartial.flare.aggregators.RuleAggregator"] is None  # the persistor checks for the server


def test_server_stops_a_job_for_another_runtime_version(tmp_path):
    from fedpartial.flare.persistor import FedPartialPersistor

    model = {"arch": "small_cnn", "arch_args": {"width": 4}, "in_channels": 1, "class_names": ["a", "b"],
             "task": "multi-label"}

    development, provisioned = tmp_path / "poc_server", tmp_path / "kit"
    development.mkdir()
    (provisioned / "local").mkdir(parents=True)
    (provisioned / "local" / "fedpartial_site.json").write_text('{"format_version": 1, "datasets": {}}')
    (provisioned / "job").mkdir()  # the job's run folder holds its meta.json: one client app
    (provisioned / "job" / "meta.json").write_text('{"deploy_map": {"app": ["@ALL"]}}')

    def start(version, root=development):
        fl_ctx = FLContext()
        engine = mock.MagicMock()
        engine.get_workspace.return_value.get_root_dir.return_value = str(root)
        engine.get_workspace.return_value.get_run_dir.return_value = str(root / "job")
        fl_ctx.set_prop("__engine__", engine, private=True, sticky=False)
        FedPartialPersistor(model, runtime_version=version).handle_event(EventType.START_RUN, fl_ctx)
        panics = [c for c in engine.fire_event.call_args_list if c.args[0] == EventType.FATAL_SYSTEM_ERROR]
        return panics, fl_ctx.get_prop(FLContextKey.EVENT_DATA)

    # a development server takes the identity, the bare version, or a job that names none
    for same in (IDENTITY, VERSION, ""):
        assert start(same) == ([], None)
    assert start(IDENTITY, provisioned) == ([], None)
    panics, reason = start("9.9.9")
    assert len(panics) == 1
    assert reason.startswith(f"the job needs fedpartial runtime 9.9.9 but the server has fedpartial {IDENTITY} "
                             f"installed")
    # a provisioned server wants the content hash: a bare version or none is refused
    for version, words in ((VERSION, f"needs fedpartial runtime {VERSION} but"), ("", "names no 'runtime_version'")):
        panics, reason = start(version, provisioned)
        assert len(panics) == 1 and words in reason, reason
    other_code = VERSION + "+sha256.000000000000"  # same version, other files
    panics, reason = start(other_code, provisioned)
    assert len(panics) == 1 and other_code in reason
    # two client apps: one site could run other settings than the rest
    (provisioned / "job" / "meta.json").write_text('{"deploy_map": {"app": ["server", "site-1"], "app2": ["site-2"]}}')
    panics, reason = start(IDENTITY, provisioned)
    assert len(panics) == 1 and "deploy_map gives the sites 2 different apps (app, app2)" in reason


def _provision(tmp_path, **policy):
    project = provision.localhost_project("policy", 18102, ["site-1", "site-2"], site_policy=policy)
    prod = provision.provision(provision.write_project(str(tmp_path / "p.yml"), project), str(tmp_path / "ws"),
                               env=provision.kit_env(str(tmp_path)))
    return Path(prod)


def _authorizer(kit: Path, org: str) -> FLAuthorizer:
    return FLAuthorizer(org, json.loads((kit / "local" / "authorization.json").read_text()))


def _may(authorizer, role, right):
    user = Person("u@x.org", "hospital_a", role)
    return authorizer.authorize(AuthzContext(right=right, user=user, submitter=user))[0]


def test_site_policy_allows_fedpartial_classes_and_no_byoc(tmp_path):
    privacy = tmp_path / "privacy.json"
    privacy.write_text(json.dumps({"scopes": [{"name": "public", "task_result_filters": []}],
                                   "default_scope": "public"}))
    from fedpartial.flare.allowed import CLASS_ALLOW_LIST
    from fedpartial_tools.deploy.builders import SCHEDULE_TRIES, SITE_RESOURCES

    prod = _provision(tmp_path, allow_byoc=False, privacy_file=str(privacy))
    for kit in ("localhost", "site-1", "site-2"):
        local = prod / kit / "local"
        default = json.loads((local / "resources.json.default").read_text())
        written = json.loads((local / "resources.json").read_text())
        # the runtime's exact list instead of FLARE's; the log streamer / receiver gone; a site's resource
        # manager and consumer fedpartial's (jobs counted), the server's scheduler trying for days;
        # everything else (job store) unchanged
        assert written["class_allow_list"] == list(CLASS_ALLOW_LIST) and len(default["class_allow_list"]) == 88
        dropped = "site_log_streamer" if kit.startswith("site") else "log_receiver"
        # the server adds its check of a job's meta at submission
        added = [] if kit.startswith("site") else [{"id": "submission_gate", "args": {},
                                                    "path": "fedpartial.flare.job_gate.SubmissionGate"}]
        expected = [dict(c, path=SITE_RESOURCES.get(c["path"], c["path"])) if kit.startswith("site") else
                    dict(c, args={**c["args"], "max_schedule_count": SCHEDULE_TRIES}) if c["id"] == "job_scheduler"
                    else c for c in default["components"] if c["id"] != dropped]
        assert [c for c in written["components"]] == expected + added
        # the job gate checks every job deployed here against the schema and the kit's limits
        side = "server" if kit == "localhost" else "client"
        assert written["app_validator"] == {"path": "fedpartial.flare.job_gate.JobGate", "args": {"side": side}}
        same = {"class_allow_list", "components", "allow_log_streaming", "app_validator"}
        assert {k: v for k, v in written.items() if k not in same} == \
               {k: v for k, v in default.items() if k not in same}
        authz = json.loads((local / "authorization.json").read_text())
        assert sorted(authz["permissions"]) == ["lead", "member", "org_admin", "project_admin"]
        assert all(rights["byoc"] == "none" for rights in authz["permissions"].values())
        a = _authorizer(prod / kit, "hospital_a")
        for role in ("project_admin", "lead", "org_admin", "member"):
            assert not _may(a, role, "byoc"), role
        # the other rights stay FLARE's defaults (shell commands: own organisation's sites only)
        for right in ("submit_job", "abort_job", "download_job", "shutdown", "sys_info", "ls", "check_status"):
            assert _may(a, "project_admin", right), right
        assert not _may(_authorizer(prod / kit, "hospital_b"), "project_admin", "ls")
        assert _may(a, "lead", "submit_job") and not _may(a, "org_admin", "submit_job")
        assert not _may(a, "member", "submit_job") and _may(a, "member", "list_jobs")
    # the privacy policy goes to the sites, as is; the server has none
    for site in ("site-1", "site-2"):
        assert (prod / site / "local" / "privacy.json").read_bytes() == privacy.read_bytes()
    assert not (prod / "localhost" / "local" / "privacy.json").exists()


def test_site_policy_can_keep_byoc(tmp_path):
    from fedpartial.flare.allowed import CLASS_ALLOW_LIST

    prod = _provision(tmp_path, allow_byoc=True)
    local = prod / "site-1" / "local"
    written = json.loads((local / "authorization.json").read_text())["permissions"]
    default = json.loads((local / "authorization.json.default").read_text())["permissions"]
    # FLARE's byoc rights; only the shell commands and job error lines are narrowed to the site's own organisation
    assert {role: rights["byoc"] for role, rights in written.items() if "byoc" in rights} == \
        {"project_admin": "any", "org_admin": "none", "lead": "any"}
    assert written["lead"] == dict(default["lead"], show_errors="o:site", reset_errors="o:site")
    assert written["project_admin"]["shell_commands"] == "o:site"
    a = _authorizer(prod / "site-1", "hospital_a")
    assert _may(a, "lead", "byoc") and _may(a, "project_admin", "byoc") and not _may(a, "org_admin", "byoc")
    assert json.loads((local / "resources.json").read_text())["class_allow_list"] == list(CLASS_ALLOW_LIST)


def test_site_policy_names_a_bad_privacy_file(tmp_path):
    bad = tmp_path / "privacy.json"
    bad.write_text("{not json")
    with pytest.raises(RuntimeError, match=re.escape(f"privacy_file '{bad}' is not valid JSON")):
        _provision(tmp_path, privacy_file=str(bad))
    with pytest.raises(RuntimeError, match=re.escape("'fedpartial' must be a package prefix ending in '.'")):
        _provision(tmp_path, class_prefixes=["fedpartial"])


@pytest.mark.parametrize("name", ["project.yml", "project_localhost.yml"])
def test_shipped_projects_use_the_site_policy(name):
    builders = yaml.safe_load((REPO / "provisioning" / name).read_text())["builders"]
    paths = [b["path"] for b in builders]
    policy = paths.index(provision.SITE_POLICY_BUILDER)
    assert policy > paths.index(provision.STATIC_FILE_BUILDER)  # it edits what StaticFileBuilder wrote
    # the builder's own allow-list (no prefix), no code with jobs, no log streaming, every site
    # behind a published aggregate
    assert builders[policy]["args"] == {"allow_byoc": False, "allow_log_streaming": False,
                                        "privacy_file": "privacy.json", "min_sites_per_round": "all"}


def test_docker_project_writes_compose_and_docker_scripts(tmp_path):
    """Provisioning outputs for the container image (docker cannot run on this machine: the files
    are checked, not started)."""
    image = f"fedpartial:{VERSION}"
    project = yaml.safe_load((REPO / "provisioning" / "project_localhost.yml").read_text())
    project["participants"][0]["fed_learn_port"] = 18103
    derived = provision.docker_project(project, image, project_dir=str(REPO / "provisioning"))
    prod = Path(provision.provision(provision.write_project(str(tmp_path / "p.yml"), derived),
                                    str(tmp_path / "ws"), env=provision.kit_env(str(tmp_path))))
    # the derived file lives elsewhere: its privacy file is the shipped one, by absolute path
    assert (prod / "site-1" / "local" / "privacy.json").read_bytes() == \
        (REPO / "provisioning" / "privacy.json").read_bytes()
    compose = yaml.safe_load((prod / "compose.yaml").read_text())
    assert sorted(compose["services"]) == ["localhost", "site-1", "site-2"]
    for name, service in compose["services"].items():
        assert service["volumes"][0] == f"./{name}:${{WORKSPACE}}"  # the kit, mounted
        assert service["build"] == "nvflare_compose" and service["container_name"] == name
    assert "uid=site-2" in compose["services"]["site-2"]["command"]
    assert "nvflare.private.fed.app.server.server_train" in compose["services"]["localhost"]["command"]
    env = dict(line.split("=", 1) for line in (prod / ".env").read_text().split())
    assert env["WORKSPACE"] == "/workspace" and env["PYTHON_EXECUTABLE"] == "/usr/local/bin/python3"
    assert (prod / "nvflare_compose" / "Dockerfile").read_text().splitlines()[0] == f"FROM {image}"
    assert (prod / "nvflare_compose" / "requirements.txt").read_text() == ""
    for kit in ("localhost", "site-1"):
        assert f"DOCKER_IMAGE={image}\n" in (prod / kit / "startup" / "docker.sh").read_text()
    # the site policy is still written
    from fedpartial.flare.allowed import CLASS_ALLOW_LIST
    assert json.loads((prod / "site-1" / "local" / "resources.json").read_text())["class_allow_list"] == \
        list(CLASS_ALLOW_LIST)
    # the image installs this runtime wheel on the official python image (/usr/local/bin/python3), as non-root
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert "FROM python:${PYTHON_VERSION}-slim" in dockerfile
    assert "fedpartial_runtime-${RUNTIME_VERSION}-py3-none-any.whl" in dockerfile
    assert "\nUSER flare\n" in dockerfile and 'VOLUME ["/workspace"]' in dockerfile
