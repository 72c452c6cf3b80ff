"""Operating a cluster from outside it: preflight planning, capacity checks, deploying and
inspecting the Serve application, and the KubeRay/Helm schema."""
