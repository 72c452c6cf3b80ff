"""Speculative decoding: proposals (n-gram prompt lookup) verified in one forward pass.

config.py             SpeculativeConfig: vLLM's ``speculative_config`` dict, validated
ngram.py              the n-gram (prompt lookup) proposer, incremental per request
grammar.py            structured outputs: proposals checked, k + 1 mask rows (head side)
verify.py             one step's verification on the sampling worker
rejection_sampler.py  greedy equality, or rejection sampling (temperature > 0); logprobs
metrics.py            proposed / accepted counts, per-position acceptance
"""
