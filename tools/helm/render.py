"""Lints and renders a Helm chart with Helm's own engine, and validates what it renders.

    render.py CHART VALUES [--name NAME] [--namespace NS] [--kube-version X.Y]

VALUES is a YAML or JSON values file. Steps, each failing the run (exit 1, the reason on
stderr):
  1. the values against the chart's values.schema.json (Helm v4, as a library: PyPI
     helm-python-sdk);
  2. `helm lint --strict` with those values;
  3. the chart rendered as `helm install` would, offline (`lookup` finds nothing);
  4. every rendered document parsed (a duplicate key is an error, as kubectl's strict decoding
     makes it) and every object of a built-in Kubernetes kind validated against Kubernetes'
     OpenAPI schema, strictly (unknown fields are errors), with kubernetes-validate.
Objects of kinds defined by CRDs (Istio, Envoy Gateway, the Gateway API, Prometheus Operator)
have no schema offline and are listed as not validated: their checks are the caller's. The pod
spec an EnvoyProxy's Deployment patch carries is validated, as a Pod.

Prints one JSON document: the tools' versions, the lint messages, and every object rendered
with the template it came from. Run with tools/helm/install.sh's venv.
"""

import argparse
import json
import sys

import helm_python as helm
import kubernetes_validate
import yaml

# API groups whose kinds are CRDs: no schema in kubernetes-validate.
CRD_GROUPS = {
    "networking.istio.io",
    "extensions.istio.io",
    "security.istio.io",
    "telemetry.istio.io",
    "gateway.envoyproxy.io",
    "gateway.networking.k8s.io",
    "monitoring.coreos.com",
}


class UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a mapping with the same key twice."""


def _construct_mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def embedded_pod(obj):
    """The pod spec an EnvoyProxy's Deployment patch adds (the sidecar, its init containers and
    volumes), as a Pod, so that its containers are checked against Kubernetes' schema too."""
    if obj.get("kind") != "EnvoyProxy":
        return None
    deployment = obj["spec"]["provider"]["kubernetes"]["envoyDeployment"]
    spec = deployment["patch"]["value"]["spec"]["template"]["spec"]
    name = obj["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-patch"}, "spec": spec}


def validate(template, obj, kube):
    """Validates a built-in kind against Kubernetes' OpenAPI schema, strictly."""
    try:
        kubernetes_validate.validate(obj, kube, strict=True)
    except kubernetes_validate.SchemaNotFoundError as e:
        fail(f"{template}: {e.message}")
    except kubernetes_validate.ValidationError as e:
        path = "/".join(str(p) for p in e.path)
        fail(f"{template}: {obj['kind']} {obj['metadata'].get('name')}: {path}: {e.message}")


def fail(message):
    print(message, file=sys.stderr)
    sys.exit(1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chart")
    parser.add_argument("values")
    parser.add_argument("--name", default="kvgate")
    parser.add_argument("--namespace", default="default")
    parser.add_argument(
        "--kube-version",
        default=kubernetes_validate.latest_version(),
        help="the Kubernetes version to validate against (default: the newest bundled)",
    )
    args = parser.parse_args()

    with open(args.values) as f:
        values = helm.values_from_yaml(f.read())
    kube = args.kube_version.lstrip("v")

    with helm.Chart.load(args.chart) as chart:
        try:
            chart.validate_schema(values)
        except helm.HelmError as e:
            fail(f"values.schema.json: {e}")
        report = helm.lint(args.chart, values, strict=True, namespace=args.namespace, kube_version=f"v{kube}")
        problems = [m for m in report["messages"] if m["severity"] >= 2] + [{"error": e} for e in report["errors"]]
        if problems:
            fail("helm lint:\n" + "\n".join(f"  {m.get('path', '')}: {m['error']}" for m in problems))
        try:
            rendered = chart.render(values, name=args.name, namespace=args.namespace, is_install=True)
        except helm.HelmError as e:
            fail(f"helm template: {e}")

    objects, validated, unvalidated = [], 0, set()
    for template in sorted(rendered):
        if not template.endswith((".yaml", ".yml")):
            continue
        try:
            docs = list(yaml.load_all(rendered[template], Loader=UniqueKeyLoader))
        except yaml.YAMLError as e:
            fail(f"{template}: {e}\n{rendered[template]}")
        for obj in docs:
            if obj is None:
                continue
            kind, api = obj.get("kind"), obj.get("apiVersion", "")
            group = api.split("/")[0] if "/" in api else ""
            if group in CRD_GROUPS:
                unvalidated.add(f"{kind}.{group}")
                pod = embedded_pod(obj)
                if pod is not None:
                    validate(template, pod, kube)
                    validated += 1
            else:
                validate(template, obj, kube)
                validated += 1
            objects.append({"template": template, "object": obj})

    json.dump(
        {
            "helm": helm.helm_sdk_version(),
            "helm_python_sdk": helm.__version__,
            "kubernetes_validate": kubernetes_validate.__version__,
            "kubernetes": kubernetes_validate.utils.major_minor(kube),
            "lint": report["messages"],
            "validated": validated,
            "not_validated": sorted(unvalidated),
            "objects": objects,
        },
        sys.stdout,
        indent=1,
        default=str,
    )


if __name__ == "__main__":
    main()
