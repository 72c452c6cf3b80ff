"""The serving cluster: the engine on Ray and Ray Serve, behind an OpenAI and gRPC API.

Subpackages by role, each importing only from its own layer and those below it
(``tests/test_layering.py`` checks every import, module-level or inside a function):

    cli.py      the ``cluster`` command                                        (top)
    bench/      ``cluster bench``: throughput, serving, prefix routing, soak
    ops/        from outside a cluster: preflight plan, capacity, deploy / status, KubeRay schema
    serving/    Serve deployments and what runs in them: ingress (HTTP, gRPC), LLMServer, head
                actor, token channel, routing, autoscaling, metrics, scale-to-zero, build_app
    runtime/    Ray execution of one engine: RayExecutor, worker actors, step dispatch,
                placement arithmetic, load-progress records
    config/     the deployment YAML, checked before anything starts
    api/        the wire protocol: OpenAI payloads, typed ingress/replica messages, tool
                parsers, API keys, error bodies
    proto/      the generated gRPC stubs (same layer as api/)                      (bottom)

``api`` sits below ``config`` because the config checks a model's ``tool_call_parser`` against
the parsers' registry, while nothing in ``api`` reads the config. ``ops`` is above ``serving``
(``deploy`` builds the app with ``serving.serve.build_app``) while the config it reads is near the
bottom: operating a cluster is two layers, its config and its actions. The config does name two
``serving`` classes, the prefix router and the autoscaling policy, as strings that Serve
imports on its controller; they are option values, not imports, and the test does not see them.
"""
