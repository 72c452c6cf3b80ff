"""The wire protocol, lowest layer of ``cluster``: the OpenAI payloads and their validation, the
typed messages between the ingress and a model's replicas, tool-call parsers, API-key checks and
the error shapes clients see. Pure data and parsing: no Ray, no Serve, no engine."""
