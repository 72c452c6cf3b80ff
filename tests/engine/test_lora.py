"""Multi-LoRA serving in the engine: greedy output under each adapter equals HF + PEFT token for
token (fp32) in mixed batches with chunked prefill and preemption; more adapters than slots all
finish; the adapter keys the prefix cache; bad adapters are a 400 that harms nothing in flight;
TP = 2 equals TP = 1 with adapters; adapters of a checkpoint's fused modules (Phi-3's qkv_proj,
gate_up_proj), whose target_modules name modules the model lacks, or LoRA-GA's are served exactly
too; vLLM's ``LoRARequest`` (fields, equality by name, ``~`` paths, ``load_inplace``)."""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine import LLM, InvalidRequestError, LoRARequest, SamplingParams
from engine.builtin.catalog import make_tiny_lora, resolve_model_source

MODEL = "builtin:tiny-llama"
MAX_TOKENS = 12
# Interleaved: base, A, B, ... with prompt lengths crossing block and chunk boundaries.
PROMPT_LENGTHS = [5, 40, 17, 70, 3, 33, 26, 9]


class Adapters:
    """Three adapters of different ranks and target modules, and HF + PEFT greedy references."""

    def __init__(self, root: Path) -> None:
        self.paths = {
            "a": make_tiny_lora(MODEL, root / "a", 8, ["q_proj", "v_proj", "down_proj"], seed=1),
            "b": make_tiny_lora(
                MODEL, root / "b", 4, ["k_proj", "o_proj", "gate_proj", "up_proj"], seed=2
            ),
            "c": make_tiny_lora(
                MODEL,
                root / "c",
                16,
                ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                seed=3,
                lora_alpha=8,
                use_rslora=True,
            ),
        }
        self.requests = {
            name: LoRARequest(name, i + 1, str(path))
            for i, (name, path) in enumerate(self.paths.items())
        }
        rng = random.Random(0)
        self.prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in PROMPT_LENGTHS]
        self.base_path = resolve_model_source(MODEL)
        self._models: dict[str | None, Any] = {}
        self._expected: dict[tuple[int, str | None], list[int]] = {}

    def hf_model(self, name: str | None) -> Any:
        if name not in self._models:
            model = AutoModelForCausalLM.from_pretrained(self.base_path, dtype=torch.float32)
            if name is not None:
                model = PeftModel.from_pretrained(model, str(self.paths[name]))
            self._models[name] = model.eval()
        return self._models[name]

    def expected(self, index: int, name: str | None) -> list[int]:
        key = (index, name)
        if key not in self._expected:
            prompt = self.prompts[index]
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = self.hf_model(name).generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=MAX_TOKENS,
                    pad_token_id=0,
                )
            self._expected[key] = out[0, len(prompt) :].tolist()
        return self._expected[key]

    def lora(self, name: str | None) -> LoRARequest | None:
        return self.requests[name] if name is not None else None

    def add(self, name: str, path: Path, lora_int_id: int) -> LoRARequest:
        """Another adapter, its HF + PEFT reference read from ``path`` as it is."""
        self.paths[name] = path
        self.requests[name] = LoRARequest(name, lora_int_id, str(path))
        return self.requests[name]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    return Adapters(tmp_path_factory.mktemp("loras"))


def _generate(llm: LLM, adapters: Adapters, names: list[str | None]) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in adapters.prompts[: len(names)]]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    loras = [adapters.lora(n) for n in names]
    outputs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _assert_clean(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.check_integrity()
    stats = engine.get_kv_cache_stats()
    assert stats.free == stats.total
    assert set(engine.request_state_sizes().values()) == {0}
    assert engine.executor.collective_rpc("num_request_states") == [0]


def test_adapters_change_the_output(adapters: Adapters) -> None:
    # Otherwise the equality tests below would prove nothing.
    outputs = {n: adapters.expected(1, n) for n in (None, "a", "b", "c")}
    assert len({tuple(v) for v in outputs.values()}) == 4


def test_mixed_batch_with_chunked_prefill_and_preemption_equals_hf_peft(
    adapters: Adapters,
) -> None:
    names = [None, "a", "b", "a", "b", None, "a", "b"]
    llm = LLM(
        MODEL,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        max_num_batched_tokens=32,
        block_size=8,
        num_kv_blocks=14,
    )
    got = _generate(llm, adapters, names)
    assert got == [adapters.expected(i, n) for i, n in enumerate(names)]
    assert llm.llm_engine.scheduler.num_preemptions > 0
    _assert_clean(llm)


def test_more_adapters_than_slots_all_finish_unchanged(adapters: Adapters) -> None:
    names = ["a", "b", "c", None, "c", "a", "b", "c"]
    llm = LLM(MODEL, enable_lora=True, max_loras=2, max_cpu_loras=3, max_num_batched_tokens=64)
    engine = llm.llm_engine
    distinct_per_step: list[int] = []
    schedule = engine.scheduler.schedule

    def recording_schedule() -> Any:
        out = schedule()
        ids = {engine.scheduler.requests[r].lora_int_id for r in out.num_scheduled_tokens}
        distinct_per_step.append(len(ids - {0}))
        return out

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    got = _generate(llm, adapters, names)
    assert got == [adapters.expected(i, n) for i, n in enumerate(names)]
    assert max(distinct_per_step) == 2
    # Every adapter got a slot at some point; at most two are resident.
    assert len([s for s in engine.lora_slots.specs if s is not None]) == 2
    _assert_clean(llm)


def test_same_prompt_under_another_adapter_shares_no_prefix_blocks(adapters: Adapters) -> None:
    llm = LLM(MODEL, enable_lora=True, max_loras=2, block_size=8)
    prompt = [{"prompt_token_ids": adapters.prompts[3]}]  # 70 tokens: 8 full blocks
    params = SamplingParams(temperature=0, max_tokens=4)

    def cached(lora: LoRARequest | None) -> int:
        out = llm.generate(prompt, params, lora_request=lora, use_tqdm=False)
        return out[0].num_cached_tokens

    assert cached(adapters.lora("a")) == 0
    assert cached(adapters.lora("b")) == 0
    assert cached(None) == 0
    assert cached(adapters.lora("a")) == 64
    assert cached(adapters.lora("b")) == 64
    _assert_clean(llm)


# ---- bad adapters ---------------------------------------------------------------------------


def _broken_copy(adapters: Adapters, tmp_path: Path, how: str) -> str:
    path = tmp_path / how
    shutil.copytree(adapters.paths["a"], path)
    config_file = path / "adapter_config.json"
    weights_file = path / "adapter_model.safetensors"
    config = json.loads(config_file.read_text())
    if how == "missing_weights":
        weights_file.unlink()
    elif how == "bad_json":
        config_file.write_text("{not json")
    elif how == "unsupported_module":
        weights = load_file(str(weights_file))
        weights["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)
        save_file(weights, str(weights_file))
    elif how == "unsupported_target":  # as PEFT saves an adapter of embed_tokens
        weights = load_file(str(weights_file))
        weights["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(8, 1024)
        save_file(weights, str(weights_file))
        targets = [*config["target_modules"], "embed_tokens"]
        config_file.write_text(json.dumps({**config, "target_modules": targets}))
    elif how == "wrong_shape":
        weights = load_file(str(weights_file))
        key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
        weights[key] = torch.zeros(48, 8)
        save_file(weights, str(weights_file))
    elif how == "dora":
        config_file.write_text(json.dumps({**config, "use_dora": True}))
    elif how in ("pissa", "olora"):  # as PEFT saves an adapter it did not convert
        init = {"pissa": "pissa_niter_4", "olora": "olora"}[how]
        config_file.write_text(json.dumps({**config, "init_lora_weights": init}))
    elif how in ("kasa", "bdlora"):  # as PEFT saves them: a field, and weights of their own
        weights = load_file(str(weights_file))
        layer = "base_model.model.model.layers.0.self_attn"
        if how == "kasa":
            variant = {"kasa_config": {"beta": 1e-4, "gamma": 1e-3}}
            weights[f"{layer}.q_proj.lora_diag"] = torch.ones(8)
        else:  # block-diagonal: B holds one of nblocks=2 blocks
            variant = {"use_bdlora": {"nblocks": 2, "target_modules_bd_b": ["q_proj"]}}
            weights[f"{layer}.q_proj.lora_B.weight"] = torch.zeros(64, 4)
        save_file(weights, str(weights_file))
        config_file.write_text(json.dumps({**config, **variant}))
    elif how == "qalora":
        config_file.write_text(json.dumps({**config, "use_qalora": True}))
    return str(path)


BAD_ADAPTERS = {
    "missing_weights": "has no adapter_model.safetensors",
    "bad_json": "adapter_config.json is not valid JSON",
    "unsupported_module": "lm_head.lora_A.weight' is not supported",
    "unsupported_target": "embed_tokens.lora_embedding_A' is not supported",
    "wrong_shape": r"q_proj.lora_B.weight' has shape \[48, 8\].*needs \[64, 8\]",
    "dora": "use_dora=True is not supported",
    "pissa": "init_lora_weights='pissa_niter_4' is not supported: PEFT rewrites the base",
    "olora": "init_lora_weights='olora' is not supported: PEFT rewrites the base",
    # PEFT's variants refused by name, before their weights' shapes are looked at.
    "kasa": "kasa_config: not supported",
    "bdlora": "use_bdlora: not supported",
    "qalora": "use_qalora: not supported",
}


@pytest.fixture(scope="module")
def lora_llm() -> LLM:
    return LLM(MODEL, enable_lora=True, max_loras=2, max_lora_rank=8)


@pytest.mark.parametrize("how", sorted(BAD_ADAPTERS))
def test_bad_adapter_is_an_invalid_request_naming_the_problem(
    adapters: Adapters, lora_llm: LLM, tmp_path: Path, how: str
) -> None:
    lora = LoRARequest(how, 50, _broken_copy(adapters, tmp_path, how))
    with pytest.raises(InvalidRequestError, match=BAD_ADAPTERS[how]) as info:
        lora_llm.llm_engine.add_request("bad", [1, 2, 3], lora_request=lora)
    assert info.value.param == "lora_request"
    assert str(tmp_path) not in str(info.value)  # a server passes it on to its client
    assert lora_llm.llm_engine.get_num_unfinished_requests() == 0


def test_rank_above_max_lora_rank_is_refused(adapters: Adapters, lora_llm: LLM) -> None:
    lora = adapters.lora("c")  # r = 16 > max_lora_rank 8
    with pytest.raises(InvalidRequestError, match=r"rank r=16 exceeds max_lora_rank \(8\)"):
        lora_llm.llm_engine.add_request("big", [1, 2, 3], lora_request=lora)


def test_missing_directory_and_bad_ids_are_refused(adapters: Adapters, lora_llm: LLM) -> None:
    engine = lora_llm.llm_engine
    with pytest.raises(InvalidRequestError, match="is not a directory"):
        engine.add_request("x", [1], lora_request=LoRARequest("gone", 7, "/nonexistent/lora"))
    with pytest.raises(InvalidRequestError, match="lora_int_id must be a positive integer"):
        engine.add_request("x", [1], lora_request=LoRARequest("a", 0, str(adapters.paths["a"])))
    engine.add_request("x", [1], lora_request=adapters.lora("a"))
    rebound = LoRARequest("other", adapters.lora("a").lora_int_id, str(adapters.paths["b"]))
    with pytest.raises(InvalidRequestError, match="lora_int_id 1 already names adapter 'a'"):
        engine.add_request("y", [1], lora_request=rebound)
    engine.abort_request("x")


def test_lora_request_without_enable_lora_is_refused(adapters: Adapters) -> None:
    llm = LLM(MODEL)
    with pytest.raises(InvalidRequestError, match="LoRA is not enabled"):
        llm.generate([[1, 2]], lora_request=adapters.lora("a"), use_tqdm=False)


def test_bad_adapter_does_not_hurt_a_request_in_flight(
    adapters: Adapters, lora_llm: LLM, tmp_path: Path
) -> None:
    engine = lora_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    engine.add_request("good", adapters.prompts[1], params, lora_request=adapters.lora("a"))
    engine.step()
    for i, how in enumerate(sorted(BAD_ADAPTERS)):
        bad = LoRARequest(how, 60 + i, _broken_copy(adapters, tmp_path, how))
        with pytest.raises(InvalidRequestError):
            engine.add_request(f"bad-{how}", adapters.prompts[2], params, lora_request=bad)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final is not None and final.outputs[0].token_ids == adapters.expected(1, "a")


# ---- vLLM's adapters and LoRARequest --------------------------------------------------------


def _greedy(llm: LLM, adapters: Adapters, index: int, lora: LoRARequest) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    prompt = {"prompt_token_ids": adapters.prompts[index]}
    [out] = llm.generate(prompt, params, lora_request=lora, use_tqdm=False)
    return list(out.outputs[0].token_ids)


def test_target_modules_naming_modules_the_model_lacks_are_served_as_hf_peft(
    adapters: Adapters, lora_llm: LLM, tmp_path: Path
) -> None:
    """PEFT adapts the listed modules the model has and saves only their weights (a config
    written for several architectures); the weights say what is adapted, as in vLLM."""
    targets = ["q_proj", "v_proj", "c_attn", "query_key_value"]
    path = make_tiny_lora(MODEL, tmp_path / "multi", 8, targets, seed=7)
    assert "c_attn" in json.loads((path / "adapter_config.json").read_text())["target_modules"]
    lora = adapters.add("multi", path, 80)
    assert adapters.expected(4, "multi") != adapters.expected(4, None)
    assert _greedy(lora_llm, adapters, 4, lora) == adapters.expected(4, "multi")


def test_lora_ga_initialised_adapter_is_served_as_hf_peft(
    adapters: Adapters, lora_llm: LLM, tmp_path: Path
) -> None:
    """PEFT loads a saved LoRA-GA adapter as a plain one (no gradients: Gaussian init, then the
    saved weights), leaving the base model as it is."""
    path = tmp_path / "lora_ga"
    shutil.copytree(adapters.paths["a"], path)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(
        json.dumps({**config, "init_lora_weights": "lora_ga"})
    )
    lora = adapters.add("lora_ga", path, 81)
    assert _greedy(lora_llm, adapters, 5, lora) == adapters.expected(5, "lora_ga")
    assert adapters.expected(5, "lora_ga") == adapters.expected(5, "a")


def test_lora_request_has_vllms_fields_and_compares_by_name() -> None:
    import msgspec

    lora = LoRARequest("sql", 1, "/loras/sql", base_model_name="meta-llama/x", load_inplace=True)
    assert (lora.base_model_name, lora.load_inplace) == ("meta-llama/x", True)
    bare = LoRARequest(lora_name="sql", lora_int_id=2)
    assert (bare.lora_path, bare.base_model_name, bare.load_inplace) == ("", None, False)
    assert bare == lora and hash(bare) == hash(lora) and {lora: 1}[bare] == 1
    assert LoRARequest("other", 1, "/loras/sql") != lora
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(lora), type=LoRARequest)
    assert decoded.identity == lora.identity and decoded.load_inplace


def test_lora_path_is_expanded_and_made_absolute_where_the_request_is_made(
    adapters: Adapters, lora_llm: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    shutil.copytree(adapters.paths["a"], home / "a")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home)
    by_home, relative = LoRARequest("home", 82, "~/a"), LoRARequest("rel", 83, "a")
    assert by_home.lora_path == relative.lora_path == str(home / "a")
    monkeypatch.chdir(tmp_path)  # the engine reads the path the request was made with
    for lora in (by_home, relative):
        assert _greedy(lora_llm, adapters, 2, lora) == adapters.expected(2, "a")


def test_empty_lora_path_is_refused_when_a_request_names_it(lora_llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="lora_path must be a non-empty string"):
        lora_llm.llm_engine.add_request("x", [1, 2], lora_request=LoRARequest("none", 84))


def test_an_id_is_bound_to_its_name_and_path_although_requests_compare_by_name(
    adapters: Adapters, lora_llm: LLM
) -> None:
    engine = lora_llm.llm_engine
    engine.add_request("x", [1], lora_request=LoRARequest("same", 85, str(adapters.paths["a"])))
    moved = LoRARequest("same", 85, str(adapters.paths["b"]))
    with pytest.raises(InvalidRequestError, match="lora_int_id 85 already names adapter 'same'"):
        engine.add_request("y", [1], lora_request=moved)
    engine.abort_request("x")


def test_load_inplace_checks_the_files_again_and_refuses_changed_ones(
    adapters: Adapters, lora_llm: LLM, tmp_path: Path
) -> None:
    """An id names one set of weights (its KV blocks are cached under it): ``load_inplace``
    re-reads the adapter, and files changed since its id was loaded need a new id."""
    path = tmp_path / "x"
    shutil.copytree(adapters.paths["a"], path)
    lora = LoRARequest("x", 86, str(path))
    again = LoRARequest("x", 86, str(path), load_inplace=True)
    assert _greedy(lora_llm, adapters, 1, lora) == adapters.expected(1, "a")
    assert _greedy(lora_llm, adapters, 1, again) == adapters.expected(1, "a")
    for file in adapters.paths["b"].iterdir():  # new files, in place
        shutil.copyfile(file, path / file.name)
    with pytest.raises(InvalidRequestError, match="load_inplace: the files of lora_int_id 86"):
        lora_llm.llm_engine.add_request("y", [1], lora_request=again)
    assert lora_llm.llm_engine.get_num_unfinished_requests() == 0
    renewed = LoRARequest("x", 87, str(path), load_inplace=True)
    assert _greedy(lora_llm, adapters, 1, renewed) == adapters.expected(1, "b")


# ---- TP = 2 equals TP = 1 ------------------------------------------------------------------


def _tp_config(tp: int, rank: int, model: str = MODEL) -> Any:
    from tests.engine.spawned_ranks import rank_config

    return rank_config(
        rank, model=model, tensor_parallel_size=tp, enable_lora=True, max_loras=2, num_kv_blocks=64
    )


def _prompt_logprobs_step(paths: dict[str, str], prompts: list[list[int]]) -> bytes:
    """One prefill step of base / A / B requests that returns every prompt position's logprobs
    (the sampler's view of all logits), as the head would send it."""
    from engine.worker.step_messages import (
        ExecuteModelRequest,
        LoRASlotSpec,
        NewRequestData,
        encode,
    )

    loras = [0, 1, 2]
    new, offset = [], 0
    for i, prompt in enumerate(prompts):
        blocks = list(range(offset, offset + -(-len(prompt) // 16)))
        offset += len(blocks)
        new.append(
            NewRequestData(
                req_id=f"r{i}",
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3),
                block_ids=blocks,
                num_computed_tokens=0,
                lora_int_id=loras[i % 3],
            )
        )
    message = ExecuteModelRequest(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=[],
        num_scheduled_tokens={f"r{i}": len(p) for i, p in enumerate(prompts)},
        total_num_scheduled_tokens=sum(len(p) for p in prompts),
        finished_req_ids=[],
        lora_slots={
            1: LoRASlotSpec(lora_int_id=1, lora_path=paths["a"]),
            0: LoRASlotSpec(lora_int_id=2, lora_path=paths["b"]),
        },
    )
    return encode(message)


def _run_worker(
    rank: int,
    tp: int,
    message: bytes,
    ports: Any,
    results: Any,
    every_rank: bool = False,
    model: str = MODEL,
) -> None:
    from engine.worker.step_messages import decode_request, encode
    from engine.worker.worker import Worker

    worker = Worker(_tp_config(tp, rank, model))
    worker.init_device()
    if tp > 1:
        if rank == 0:
            ports.put(worker.start_rendezvous("127.0.0.1"))
            port = 0
        else:
            port = ports.get(timeout=60)
        worker.init_distributed("127.0.0.1", port)
    worker.load_model()
    worker.initialize_cache(64, 0)
    output = worker.execute_model(decode_request(message))
    if rank == 0 or every_rank:
        results.put((rank, encode(output) if output is not None else None))
    worker.shutdown()


def _lists(output: Any) -> dict[str, np.ndarray]:
    return {
        rid: np.array([row[0] for row in chunk.lists.logprobs])
        for rid, chunk in output.prompt_logprobs.items()
    }


def _assert_tp2_equals_tp1(model: str, paths: dict[str, str], prompts: list[list[int]]) -> None:
    """One prefill step of base / A / B requests on TP = 1 and on TP = 2 (spawned ranks): the
    same prompt logprobs and sampled tokens."""
    from engine.worker.step_messages import decode_output

    message = _prompt_logprobs_step(paths, prompts)
    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    outputs = {}
    for tp in (1, 2):
        procs = [
            ctx.Process(
                target=_run_worker, args=(r, tp, message, ports, results), kwargs={"model": model}
            )
            for r in range(tp)
        ]
        for p in procs:
            p.start()
        outputs[tp] = decode_output(results.get(timeout=240)[1])
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    single, sharded = _lists(outputs[1]), _lists(outputs[2])
    assert sorted(single) == [f"r{i}" for i in range(len(prompts))]
    for rid in single:
        np.testing.assert_allclose(sharded[rid], single[rid], atol=1e-4, rtol=1e-4)
    assert outputs[1].sampled_token_ids == outputs[2].sampled_token_ids


@pytest.mark.slow
def test_tensor_parallel_2_equals_1_with_adapters(adapters: Adapters) -> None:
    paths = {name: str(path) for name, path in adapters.paths.items()}
    _assert_tp2_equals_tp1(MODEL, paths, adapters.prompts[:6])


# ---- adapters of a checkpoint's fused modules (Phi-3) ----------------------------------------

PHI3 = "builtin:tiny-phi3"


@pytest.fixture(scope="module")
def phi3_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """PEFT adapters on Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` (its checkpoint has no
    q_proj or gate_proj): every projection, and ``qkv_proj`` alone (PEFT's default for Phi-3)."""
    root = tmp_path_factory.mktemp("phi3-loras")
    every = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    return {
        "a": str(make_tiny_lora(PHI3, root / "a", 8, every, seed=4)),
        "b": str(make_tiny_lora(PHI3, root / "b", 4, ["qkv_proj"], seed=5, use_rslora=True)),
    }


def test_phi3_fused_module_adapters_equal_hf_peft(phi3_adapters: dict[str, str]) -> None:
    base = resolve_model_source(PHI3)
    names: list[str | None] = [None, "a", "b", "a", "b", None]
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (7, 40, 23, 70, 12, 33)]
    expected = []
    for name, prompt in zip(names, prompts):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, phi3_adapters[name])
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.eval().generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=MAX_TOKENS, pad_token_id=0,
            )  # fmt: skip
        expected.append(out[0, len(prompt) :].tolist())
    assert len({tuple(e) for e in expected[:3]}) == 3  # each adapter changes the output
    loras = [None if n is None else LoRARequest(n, ord(n), phi3_adapters[n]) for n in names]
    llm = LLM(PHI3, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              max_num_batched_tokens=32)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras,
                        use_tqdm=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in outs] == expected
    _assert_clean(llm)


@pytest.mark.slow
def test_phi3_fused_module_adapters_tensor_parallel_2_equals_1(
    phi3_adapters: dict[str, str],
) -> None:
    rng = random.Random(4)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (9, 30, 17, 44, 5, 21)]
    _assert_tp2_equals_tp1(PHI3, phi3_adapters, prompts)


def test_an_adapter_on_a_fused_module_and_its_part_is_refused(
    phi3_adapters: dict[str, str], tmp_path: Path
) -> None:
    path = tmp_path / "both"
    shutil.copytree(phi3_adapters["a"], path)
    weights = load_file(str(path / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.self_attn"
    weights[f"{prefix}.q_proj.lora_A.weight"] = torch.zeros(8, 64)
    weights[f"{prefix}.q_proj.lora_B.weight"] = torch.zeros(64, 8)
    save_file(weights, str(path / "adapter_model.safetensors"))
    llm = LLM(PHI3, enable_lora=True, max_lora_rank=8)
    with pytest.raises(InvalidRequestError, match="layer 0: q_proj and qkv_proj"):
        llm.llm_engine.add_request("x", [1, 2], lora_request=LoRARequest("both", 9, str(path)))


@pytest.mark.slow
def test_every_tensor_parallel_rank_reports_an_adapter_it_cannot_load(
    adapters: Adapters, tmp_path: Path
) -> None:
    """A rank that cannot read an adapter leaves its slot empty and says so, the non-sampling
    rank too (its output then holds only that), so the head can end the adapter's requests."""
    from engine.worker.step_messages import decode_output

    paths = {"a": str(adapters.paths["a"]), "b": str(tmp_path / "removed")}
    message = _prompt_logprobs_step(paths, adapters.prompts[:3])
    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_run_worker, args=(r, 2, message, ports, results, True))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    replies = dict(results.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    driver, other = decode_output(replies[0]), decode_output(replies[1])
    assert sorted(driver.req_ids) == ["r0", "r1", "r2"]
    assert other.req_ids == [] and other.sampled_token_ids == []
    for output in (driver, other):
        assert list(output.lora_load_errors) == [2]
        assert "removed" in output.lora_load_errors[2]


def test_an_id_read_again_after_its_files_changed_is_a_load_error_not_other_weights(
    adapters: Adapters, tmp_path: Path
) -> None:
    """A slot reused meanwhile, then its adapter read again: if its files changed, the worker
    refuses (the head then ends its requests) instead of serving other weights under the id."""
    from engine.worker.step_messages import LoRASlotSpec

    llm = LLM(MODEL, enable_lora=True, max_loras=1, max_lora_rank=16)
    manager = llm.llm_engine.executor.worker.model_runner.lora_manager
    path = tmp_path / "x"
    shutil.copytree(adapters.paths["a"], path)
    x, other = str(path), str(adapters.paths["b"])

    def load(lid: int, path: str) -> dict[int, str]:
        return manager.apply_slot_changes({0: LoRASlotSpec(lora_int_id=lid, lora_path=path)})

    assert load(5, x) == {} and load(6, other) == {}
    assert load(5, x) == {} and load(6, other) == {}  # read again, unchanged: fine
    for file in adapters.paths["c"].iterdir():  # new files, in place
        shutil.copyfile(file, path / file.name)
    errors = load(5, x)
    assert list(errors) == [5] and "files changed since this id was read" in errors[5]
    assert 5 not in manager.slot_of
    assert load(7, x) == {}  # a new id: its files are read
    assert manager.slot_of == {7: 0}


# ---- scheduler, config, async API ------------------------------------------------------------


def test_scheduler_admits_past_a_request_waiting_for_a_lora_slot() -> None:
    from engine.config_sections import SchedulerConfig
    from engine.core.block_manager import BlockManager
    from engine.core.request import Request
    from engine.core.scheduler import Scheduler
    from engine.core.scheduler_output import make_execute_model_request

    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    scheduler = Scheduler(config, BlockManager(64, 4), max_loras=2)
    loras = {i: LoRARequest(f"l{i}", i, f"/l{i}") for i in (1, 2, 3)}
    order = [("r1", 1), ("r2", 2), ("r3", 3), ("r4", 1), ("r5", 0), ("r6", 3)]
    for rid, lid in order:
        lora = loras.get(lid)
        scheduler.add_request(
            Request(rid, [5, 6, 7], SamplingParams(), max_tokens=4, lora_request=lora)
        )
    out = scheduler.schedule()
    message = make_execute_model_request(out)
    assert list(out.num_scheduled_tokens) == ["r1", "r2", "r4", "r5"]
    assert [r.lora_int_id for r in message.scheduled_new_reqs] == [1, 2, 1, 0]
    assert [r.request_id for r in scheduler.waiting] == ["r3", "r6"]  # queue order kept


def test_lora_engine_arguments_are_checked() -> None:
    from engine.config import ConfigError, EngineConfig
    from engine.config_sections import LoRAConfig

    assert LoRAConfig(max_loras=3).max_cpu_loras == 3
    expected = r"max_cpu_loras: must be an integer >= 4 \(max_loras\), got 2"
    with pytest.raises(ConfigError, match=expected):
        EngineConfig.from_kwargs(model=MODEL, enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ConfigError, match="max_lora_rank: must be an integer >= 1, got 0"):
        EngineConfig.from_kwargs(model=MODEL, max_lora_rank=0)


def test_async_engine_generates_under_an_adapter(adapters: Adapters) -> None:
    import asyncio

    from engine.client.async_llm_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_args(model=MODEL, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)

    async def run() -> list[int]:
        final = None
        async for item in engine.generate(
            {"prompt_token_ids": adapters.prompts[2]}, params, lora_request=adapters.lora("b")
        ):
            final = item
        assert final is not None
        return list(final.output.outputs[0].token_ids)

    try:
        assert asyncio.run(run()) == adapters.expected(2, "b")
    finally:
        engine.shutdown()


def test_slot_table_keeps_resident_adapters_and_reuses_the_least_recently_used_slot() -> None:
    from engine.lora import LoRASlotTable
    from engine.worker.step_messages import LoRASlotSpec

    table = LoRASlotTable(2)
    assert table.assign({1: "/a", 2: "/b"}) == {
        0: LoRASlotSpec(lora_int_id=1, lora_path="/a"),
        1: LoRASlotSpec(lora_int_id=2, lora_path="/b"),
    }
    assert table.assign({2: "/b"}) == {}
    assert table.assign({3: "/c", 2: "/b"}) == {0: LoRASlotSpec(lora_int_id=3, lora_path="/c")}
    # Id 2 rebound to another path is reloaded; its old slot no longer claims it.
    assert table.assign({2: "/b2"}) == {1: LoRASlotSpec(lora_int_id=2, lora_path="/b2")}
    assert table.slot_of(2, "/b") is None
    assert table.slot_of(3, "/c") == 0
    with pytest.raises(RuntimeError, match="3 adapters in one step but only 2 slots"):
        table.assign({1: "/a", 2: "/b", 3: "/c"})


@pytest.mark.parametrize("how", ["removed", "truncated"])
def test_adapter_gone_from_disk_after_its_check_ends_only_its_requests(
    adapters: Adapters, tmp_path: Path, how: str
) -> None:
    """The head checks an adapter when a request names it; the worker reads its weights when
    it first gets a slot. Files removed or broken in between end that adapter's requests
    ("abort"), not the engine: the other requests finish unchanged, and the adapter's next use
    is refused at once (or served again once its files are back)."""
    llm = LLM(MODEL, enable_lora=True, max_loras=2, max_lora_rank=8)
    engine = llm.llm_engine
    path = tmp_path / "a"
    shutil.copytree(adapters.paths["a"], path)
    lora = LoRARequest("moving", 9, str(path))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    engine.add_request("base", adapters.prompts[0], params)
    engine.add_request("good", adapters.prompts[2], params, lora_request=adapters.lora("a"))
    two = SamplingParams(n=2, temperature=1.0, max_tokens=4)
    engine.add_request("gone", adapters.prompts[1], two, lora_request=lora)
    backup = tmp_path / "backup"
    shutil.copytree(path, backup)
    if how == "removed":
        shutil.rmtree(path)
    else:
        weights = path / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert [o.finish_reason for o in finals["gone"].outputs] == ["abort", "abort"]
    assert finals["base"].outputs[0].token_ids == adapters.expected(0, None)
    assert finals["good"].outputs[0].token_ids == adapters.expected(2, "a")
    if how == "removed":
        with pytest.raises(InvalidRequestError, match="is not a directory"):
            engine.add_request("again", adapters.prompts[1], params, lora_request=lora)
    else:
        with pytest.raises(InvalidRequestError, match="cannot be read"):
            engine.add_request("again", adapters.prompts[1], params, lora_request=lora)
        shutil.rmtree(path)
    shutil.copytree(backup, path)
    again = llm.generate(
        {"prompt_token_ids": adapters.prompts[1]}, params, lora_request=lora, use_tqdm=False
    )
    assert again[0].outputs[0].token_ids == adapters.expected(1, "a")
    _assert_clean(llm)
