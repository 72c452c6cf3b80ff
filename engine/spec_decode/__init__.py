"""Speculative decoding: proposals (n-gram prompt lookup) verified in one forward pass.

config.py             SpeculativeConfig: vLLM's ``speculative_config`` dict, validated
ngram.py              the n-gram (prompt lookup) proposer, incremental per request
rejection_sampler.py  verification: greedy equality, or rejection sampling (temperature > 0)
metrics.py            proposed / accepted counts, per-position acceptance
"""
