"""The Helm chart: it lints and renders with Helm itself (helm-python-sdk) for the defaults and
both presets; the RayService validates against KubeRay's CRD schema and its pods against
Kubernetes' own; the serveConfigV2 inside is a Serve config whose app builder gets a deployment
config that ``cluster deploy`` accepts; and the values schema names what it rejects."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is in the test extra")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

from cluster.config import load_config  # noqa: E402
from cluster.ops.kuberay import CONFIG_SECTIONS, generated_schemas  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "llm-cluster"
CONFIGS = ROOT / "configs"
KUBERAY_CRDS = ROOT.parent / "shared" / "kuberay"
KUBE_VERSION = "1.30.0"
PRESETS = {"default": None, "tiny": "values-tiny.yaml", "llama70b": "values-llama70b.yaml"}
# Every shipped deployment config (ray-cluster.*.yaml are `ray up` cluster configs).
DEPLOYMENT_CONFIGS = sorted(
    p.name for p in CONFIGS.glob("*.yaml") if not p.name.startswith("ray-cluster.")
)

Doc = dict[str, Any]


def preset_values(preset: str) -> Doc:
    name = PRESETS[preset]
    return {} if name is None else yaml.safe_load((CHART / name).read_text())


@functools.cache
def chart() -> Any:
    return helm.Chart.load(CHART)


def render(values: Doc | None = None, name: str = "llm") -> list[Doc]:
    """Every object the chart renders (NOTES.txt aside), parsed."""
    manifests = chart().render(values or {}, name=name, namespace="serving")
    docs: list[Doc] = []
    for path, text in sorted(manifests.items()):
        if not path.endswith("NOTES.txt"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def rayservice(docs: list[Doc]) -> Doc:
    (service,) = [d for d in docs if d["kind"] == "RayService"]
    return service


def serve_config(values: Doc | None = None) -> Doc:
    return yaml.safe_load(rayservice(render(values))["spec"]["serveConfigV2"])


def pod_templates(service: Doc) -> dict[str, Doc]:
    cluster = service["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    for group in cluster["workerGroupSpecs"]:
        templates[group["groupName"]] = group["template"]
    return templates


def with_overrides(preset: str, **overrides: Any) -> Doc:
    values = preset_values(preset)
    values.update(copy.deepcopy(overrides))
    return values


# ---- Helm lint and render ------------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESETS)
def test_chart_lints_clean(preset: str) -> None:
    report = helm.lint(
        CHART, values=preset_values(preset), strict=True, kube_version=f"v{KUBE_VERSION}"
    )
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert problems == []


@pytest.mark.parametrize("preset", PRESETS)
def test_chart_renders_one_rayservice(preset: str) -> None:
    service = rayservice(render(preset_values(preset)))
    assert service["apiVersion"] == "ray.io/v1"
    assert service["metadata"]["name"] == "llm-llm-cluster"


# ---- KubeRay CRD schemas -------------------------------------------------------------------


def strict_openapi(schema: Any) -> Any:
    """An openAPIV3Schema as plain JSON Schema, as strict as the API server's field validation:
    objects with declared properties reject unknown fields (unless they preserve them), and
    ``nullable`` admits null. ``x-kubernetes-int-or-string`` already comes with its anyOf."""
    if isinstance(schema, list):
        return [strict_openapi(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_openapi(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    open_ended = "additionalProperties" in out or schema.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and not open_ended:
        out["additionalProperties"] = False
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


@functools.cache
def crd_validator(kind: str) -> Any:
    path = KUBERAY_CRDS / f"ray.io_{kind.lower()}s.yaml"
    if not path.is_file():
        pytest.skip(f"KubeRay CRDs not found at {KUBERAY_CRDS} (CI provides ../shared/kuberay)")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(path.read_text(), Loader=loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict_openapi(version["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def crd_errors(kind: str, doc: Doc) -> list[str]:
    errors = crd_validator(kind).iter_errors(doc)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]


@pytest.mark.parametrize("preset", PRESETS)
def test_rayservice_matches_kuberay_crd(preset: str) -> None:
    assert crd_errors("RayService", rayservice(render(preset_values(preset)))) == []


@pytest.mark.parametrize("preset", PRESETS)
def test_embedded_raycluster_matches_kuberay_crd(preset: str) -> None:
    spec = rayservice(render(preset_values(preset)))["spec"]["rayClusterConfig"]
    cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "llm"}}
    assert crd_errors("RayCluster", {**cluster, "spec": spec}) == []


def test_crd_check_rejects_a_field_kuberay_does_not_know() -> None:
    service = rayservice(render())
    service["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    assert any("rayStartParam" in e for e in crd_errors("RayService", service))


# ---- core Kubernetes objects ---------------------------------------------------------------


def kube_validate(doc: Doc) -> None:
    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def as_pod_template(name: str, template: Doc) -> Doc:
    """A group's pod template as a core ``PodTemplate`` object, which Kubernetes' schema knows."""
    return {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": name},
        "template": template,
    }


STORAGE = {
    "pvc": {"type": "pvc", "mountPath": "/models", "pvc": {"claimName": "models"}},
    "hostPath": {"type": "hostPath", "mountPath": "/models", "hostPath": {"path": "/data/m"}},
    "uri": {
        "type": "uri",
        "mountPath": "/models",
        "mountOnHead": True,
        "uri": {"uri": "s3://bucket/llama"},
    },
}


@pytest.mark.parametrize("preset", PRESETS)
def test_pod_templates_are_valid_kubernetes(preset: str) -> None:
    for group, template in pod_templates(rayservice(render(preset_values(preset)))).items():
        kube_validate(as_pod_template(group, template))


@pytest.mark.parametrize("storage", STORAGE)
def test_model_storage_pod_templates_are_valid_kubernetes(storage: str) -> None:
    values = with_overrides("llama70b", modelStorage=STORAGE[storage])
    for group, template in pod_templates(rayservice(render(values))).items():
        kube_validate(as_pod_template(group, template))


def test_uri_storage_copies_the_checkpoint_in_an_init_container() -> None:
    values = with_overrides("llama70b", modelStorage=STORAGE["uri"])
    spec = pod_templates(rayservice(render(values)))["h100"]["spec"]
    (init,) = spec["initContainers"]
    env = {e["name"]: e.get("value") for e in init["env"]}
    assert env == {"MODEL_URI": "s3://bucket/llama", "MODEL_DIR": "/models"}
    assert {"name": "models", "mountPath": "/models"} in init["volumeMounts"]


def test_metrics_service_is_valid_kubernetes_and_selects_the_ray_pods() -> None:
    docs = render(with_overrides("tiny", serviceMonitor={"enabled": True}))
    (service,) = [d for d in docs if d["kind"] == "Service"]
    kube_validate(service)
    labels = pod_templates(rayservice(docs))["cpu"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    selected = monitor["spec"]["selector"]["matchLabels"]
    assert selected.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]


def test_service_monitor_is_off_by_default() -> None:
    assert [d["kind"] for d in render()] == ["RayService"]


# ---- the Ray cluster -----------------------------------------------------------------------


def test_head_has_no_gpus_and_exposes_serve_grpc_metrics_dashboard_gcs() -> None:
    head = rayservice(render())["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    (container,) = head["template"]["spec"]["containers"]
    ports = {p["containerPort"] for p in container["ports"]}
    assert {8000, 9000, 8080, 8265, 6379} <= ports
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})


@pytest.mark.parametrize("preset", list(PRESETS))
def test_worker_pods_are_ready_when_health_says_every_model_serves(preset: str) -> None:
    values = preset_values(preset)
    service = rayservice(render(values))["spec"]
    port = values.get("http", {}).get("port", 8000)
    for group in service["rayClusterConfig"]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        probe = container["readinessProbe"]
        assert probe["httpGet"] == {"path": "/health", "port": port}
        assert probe["timeoutSeconds"] > 10  # /health bounds a replica's answer at 10 s
        assert "livenessProbe" not in container  # KubeRay's own (raylet health) stays
    # The head pod's readiness cannot wait for the models (KubeRay deploys once it is ready):
    # it is left out of the serve Service instead.
    assert service["excludeHeadPodFromServeSvc"] is True
    (head,) = service["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert "readinessProbe" not in head


def test_readiness_off_leaves_kuberays_probes_and_the_head_in_the_serve_service() -> None:
    service = rayservice(render(with_overrides("tiny", readiness={"enabled": False})))["spec"]
    assert "excludeHeadPodFromServeSvc" not in service
    for group in service["rayClusterConfig"]["workerGroupSpecs"]:
        assert "readinessProbe" not in group["template"]["spec"]["containers"][0]


def test_llama70b_gpu_group_requests_8_gpus_with_shm_tolerations_and_autoscaling() -> None:
    cluster = rayservice(render(preset_values("llama70b")))["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    (group,) = cluster["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (1, 1, 4)
    assert group["resources"] == {"accelerator_type:H100": "1"}
    spec = group["template"]["spec"]
    (container,) = spec["containers"]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 8
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert spec["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}


def test_llama70b_gpu_pod_holds_exactly_one_replica_and_scales_with_serve() -> None:
    values = preset_values("llama70b")
    model = load_config({"models": values["models"]}).models[0]
    (group,) = values["workerGroups"]
    assert group["gpus"] == model.world_size == 8  # TP 4 x PP 2
    assert group["maxReplicas"] == model.deployment_config.autoscaling_config.max_replicas


def test_ray_token_auth_maps_to_kuberay_auth_options() -> None:
    values = with_overrides("tiny", rayAuth={"enabled": True, "secretName": "ray-token"})
    cluster = rayservice(render(values))["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token", "secretName": "ray-token"}


# ---- secrets -------------------------------------------------------------------------------


SECRETS = {
    "apiKeys": {"secretName": "llm-api-keys", "secretKey": "keys", "envVar": "LLM_KEYS"},
    "secretEnv": [{"name": "HF_TOKEN", "secretName": "hf", "secretKey": "token"}],
}


def test_api_keys_and_tokens_come_from_secret_refs_on_every_pod() -> None:
    service = rayservice(render(with_overrides("tiny", **SECRETS)))
    for template in pod_templates(service).values():
        env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
        assert env["LLM_KEYS"] == {
            "name": "LLM_KEYS",
            "valueFrom": {"secretKeyRef": {"name": "llm-api-keys", "key": "keys"}},
        }
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}


def test_api_keys_config_names_the_secret_env_var() -> None:
    args = serve_config(with_overrides("tiny", **SECRETS))["applications"][0]["args"]
    assert args["api_keys"] == {"env": "LLM_KEYS"}
    assert load_config(args).api_keys.env == "LLM_KEYS"


def test_no_api_keys_without_a_secret() -> None:
    assert "api_keys" not in serve_config()["applications"][0]["args"]


# ---- serveConfigV2 -------------------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESETS)
def test_serve_config_args_pass_cluster_deploy_validation(preset: str) -> None:
    (app,) = serve_config(preset_values(preset))["applications"]
    assert app["import_path"] == "cluster.serving.serve:build_app"
    config = load_config(app["args"])
    models = chart().merge_values(preset_values(preset))["models"]
    assert [m.model_id for m in config.models] == [
        m["model_loading_config"]["model_id"] for m in models
    ]
    assert config.http_options.host == "0.0.0.0"


@pytest.mark.parametrize(
    ("preset", "config"), [("tiny", "tiny.yaml"), ("llama70b", "llama70b.yaml")]
)
def test_preset_models_are_the_config_files_models_one_to_one(preset: str, config: str) -> None:
    args = serve_config(preset_values(preset))["applications"][0]["args"]
    assert args["models"] == yaml.safe_load((CONFIGS / config).read_text())["models"]


@pytest.mark.parametrize("preset", PRESETS)
def test_serve_config_is_a_valid_serve_deploy_config(preset: str) -> None:
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(serve_config(preset_values(preset)))
    assert schema.http_options.host == "0.0.0.0"
    assert schema.grpc_options.grpc_servicer_functions == [
        "cluster.proto.llm_pb2_grpc.add_LLMServicer_to_server"
    ]


def test_serve_builds_the_application_from_the_rendered_args() -> None:
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.utils import import_attr
    from ray.serve.deployment import Application

    (app,) = serve_config(preset_values("tiny"))["applications"]
    builder = import_attr(app["import_path"])
    built = call_user_app_builder_with_args_if_necessary(builder, app["args"])
    assert isinstance(built, Application)


# ---- values schema -------------------------------------------------------------------------


def config_values(config: Doc) -> Doc:
    """The chart values that deploy a deployment config's app: its models and its other
    sections under their values keys (``values.yaml``: sleepMode, media, ...)."""
    values: Doc = {"models": config["models"]}
    for key, section in CONFIG_SECTIONS.items():
        if section in config:
            values[key] = config[section]
    ingress_replicas = config.get("http_options", {}).get("ingress_replicas")
    if ingress_replicas is not None:
        values["http"] = {"ingressReplicas": ingress_replicas}
    return values


@pytest.mark.parametrize("name", DEPLOYMENT_CONFIGS)
def test_every_shipped_config_deploys_through_values_as_cluster_deploy_reads_it(name: str) -> None:
    config = yaml.safe_load((CONFIGS / name).read_text())
    args = serve_config(config_values(config))["applications"][0]["args"]
    for section in ("models", *CONFIG_SECTIONS.values()):
        assert args.get(section) == config.get(section), section
    deployed = load_config(args)
    http_options = config.get("http_options", {})
    assert deployed.http_options.ingress_replicas == http_options.get("ingress_replicas", 1)


def test_take_turns_config_keeps_its_sleep_mode_through_the_chart() -> None:
    config = yaml.safe_load((CONFIGS / "gpu-take-turns.yaml").read_text())
    args = serve_config(config_values(config))["applications"][0]["args"]
    assert load_config(args).sleep_mode.max_awake_models == 2


def test_media_and_responses_store_values_reach_the_config_verbatim() -> None:
    media = {"allowed_media_domains": ["images.example.com"], "max_image_bytes": 4096}
    store = {"max_responses": 50, "ttl_s": 60}
    values = with_overrides("tiny", media=media, responsesStore=store)
    config = load_config(serve_config(values)["applications"][0]["args"])
    assert config.media.allowed_media_domains == ("images.example.com",)
    assert config.media.max_image_bytes == 4096
    assert (config.responses_store.max_responses, config.responses_store.ttl_s) == (50, 60)


def test_ingress_replicas_value_sets_the_configs_ingress_replicas() -> None:
    values = with_overrides("tiny", http={"port": 8000, "maxBodyBytes": 1 << 20})
    values["http"]["ingressReplicas"] = 3
    args = serve_config(values)["applications"][0]["args"]
    assert load_config(args).http_options.ingress_replicas == 3


def test_default_values_leave_the_optional_sections_to_the_configs_defaults() -> None:
    args = serve_config()["applications"][0]["args"]
    assert not set(CONFIG_SECTIONS.values()) & set(args)
    assert args["http_options"]["ingress_replicas"] == 1


@pytest.mark.parametrize("key", list(generated_schemas()))
def test_values_schema_config_parts_are_generated_from_cluster_config(key: str) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"][key] == generated_schemas()[key], (
        "run: python -m cluster.ops.kuberay helm/llm-cluster/values.schema.json"
    )


def render_error(values: Doc) -> str:
    with pytest.raises(helm.HelmValuesError) as info:
        render(values)
    return str(info.value)


def test_values_with_a_wrong_type_are_rejected_naming_the_key() -> None:
    message = render_error({"http": {"port": "8000"}})
    assert "/http/port" in message
    assert "want integer" in message


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"sleepMode": {"max_awake_models": "two"}}, "/sleepMode/max_awake_models"),
        (
            {"media": {"allowed_media_domains": "images.example.com"}},
            "/media/allowed_media_domains",
        ),
        ({"responsesStore": {"ttl_s": "1h"}}, "/responsesStore/ttl_s"),
        ({"http": {"ingressReplicas": "2"}}, "/http/ingressReplicas"),
    ],
)
def test_a_wrong_type_in_a_config_section_is_rejected_naming_the_key(values: Doc, key: str) -> None:
    assert key in render_error(values)


def test_an_unknown_key_in_a_config_section_is_rejected_naming_it() -> None:
    message = render_error({"media": {"allowed_domains": ["images.example.com"]}})
    assert "/media" in message
    assert "'allowed_domains'" in message


def test_values_with_an_unknown_key_are_rejected_naming_it() -> None:
    group = {**preset_values("tiny")["workerGroups"][0], "gpu": 8}
    message = render_error({"workerGroups": [group]})
    assert "/workerGroups/0" in message
    assert "'gpu'" in message


def test_an_unknown_engine_argument_in_models_is_rejected_naming_it() -> None:
    models = preset_values("tiny")["models"]
    models[0]["engine_kwargs"]["tensor_paralel_size"] = 2
    message = render_error({"models": models})
    assert "/models/0/engine_kwargs" in message
    assert "tensor_paralel_size" in message


def test_a_wrong_type_in_a_model_is_rejected_naming_the_key() -> None:
    models = preset_values("tiny")["models"]
    models[0]["deployment_config"]["num_replicas"] = "two"
    message = render_error({"models": models})
    assert "/models/0/deployment_config/num_replicas" in message


def test_lint_reports_the_schema_violation_with_the_key() -> None:
    report = helm.lint(CHART, values={"grpc": {"enabled": "yes", "port": 9000}})
    text = " ".join(report["errors"] + [m["error"] for m in report["messages"]])
    assert "/grpc/enabled" in text


def test_fractional_gpu_bundles_validate_and_a_string_amount_is_rejected() -> None:
    models = preset_values("tiny")["models"]
    models[0]["placement_group_config"] = {"bundles": [{"CPU": 0.5}]}
    chart().validate_schema(chart().merge_values({"models": models}))
    models[0]["placement_group_config"] = {"bundles": [{"GPU": "half"}]}
    message = render_error({"models": models})
    assert "/models/0/placement_group_config/bundles/0/GPU" in message


def test_model_source_is_a_string_or_a_bucket_mirror_and_nothing_else() -> None:
    models = preset_values("tiny")["models"]
    models[0]["model_loading_config"]["model_source"] = {"bucket_uri": "s3://models/tiny"}
    chart().validate_schema(chart().merge_values({"models": models}))
    models[0]["model_loading_config"]["model_source"] = 42
    assert "/models/0/model_loading_config/model_source" in render_error({"models": models})


def test_pooling_type_validates_in_any_case_as_cluster_deploy_takes_it() -> None:
    models = preset_values("tiny")["models"]
    for spelling in ("MEAN", "last", "Last"):
        models[0]["engine_kwargs"]["pooling_type"] = spelling
        chart().validate_schema(chart().merge_values({"models": models}))
    models[0]["engine_kwargs"]["pooling_type"] = "max"
    assert "/models/0/engine_kwargs/pooling_type" in render_error({"models": models})
