"""Ray Serve deployments and what runs in them: the ingress (HTTP and gRPC), the ``LLMServer``
replica and its head actor, the token channel between them, routing, autoscaling, metrics,
scale-to-zero, and ``serve.build_app``, the application builder."""
