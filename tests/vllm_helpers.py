"""Helpers for the vLLM end-to-end test and benchmark (run inside the vLLM environment).

``python tests/vllm_helpers.py SPEC.json OUT.json`` starts one vLLM engine as SPEC
says, runs its rounds of greedy generation prompt by prompt, and writes the
tokens, log-probabilities (as float.hex, so comparisons are bitwise), vLLM's
cached-token counts, timings and our manager's state after every round. Each
engine runs in its own process so that engines never share state.

SPEC keys: model (dir), blocks (num_gpu_blocks_override), offload (None or the
extra config of our spec), prompts (list of token-id lists), orders (one list
of prompt indices per round), max_tokens, corrupt_after_round (int or None: flip
bytes of every block that is on disk only, in the slot file, after that round).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
VOCAB = 512


def write_tiny_llama(path: str | os.PathLike, seed: int = 1234, *, hidden: int = 128,
                     layers: int = 2, heads: int = 4, kv_heads: int = 2,
                     max_positions: int = 2048) -> str:
    """A Llama with seeded random weights (std 0.02), saved locally: by default 2
    layers, hidden 128, 2 KV heads of dim 32 (``hidden // heads``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(path)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        initializer_range=0.02,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(path)
    return path


def shared_prefix_prompts(
    seed: int, n_prefixes: int, prefix_tokens: int, per_prefix: int, suffix_tokens: int
) -> list[list[int]]:
    """Prompts sharing long prefixes: ``per_prefix`` different suffixes on each prefix."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(n_prefixes):
        prefix = rng.integers(1, VOCAB, prefix_tokens).tolist()
        for _ in range(per_prefix):
            prompts.append(prefix + rng.integers(1, VOCAB, suffix_tokens).tolist())
    return prompts


def _read_state(path: str, timeout: float = 60.0, quiet: float = 1.5) -> dict:
    """Our manager's state file once it has stopped changing (no I/O in flight)."""
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                cur = json.load(f)
        except (OSError, ValueError):
            cur = None
        if cur is not None and cur != last:
            last, since = cur, time.monotonic()
        elif cur is not None:
            c = cur["counters"]
            busy = (c["promotions_started"] - c["promotions_ok"] - c["promotions_failed"]) or (
                c["demotions_started"] - c["demotions_ok"] - c["demotions_failed"]
            )
            if not busy and time.monotonic() - since >= quiet:
                return cur
        time.sleep(0.2)
    raise TimeoutError(f"state file {path} did not settle within {timeout} s: {last}")


def corrupt_disk_only_blocks(state: dict) -> list[dict]:
    """Flip 16 bytes inside every block that is on disk only (not also on host)."""
    from tiering.disk.slotfile import SLOT_FILE_NAME

    cands = [b for b in state["disk_blocks"] if not b["on_host"] and b["payload_offset"] is not None]
    if not cands:
        raise RuntimeError(f"no disk-only block to corrupt: {state['disk_blocks']}")
    path = os.path.join(state["disk_root"], SLOT_FILE_NAME)
    with open(path, "r+b") as f:
        for victim in cands:
            f.seek(victim["payload_offset"] + 64)
            raw = bytearray(f.read(16))
            f.seek(victim["payload_offset"] + 64)
            f.write(bytes(b ^ 0xFF for b in raw))
        f.flush()
        os.fsync(f.fileno())
    return cands


def run_engine(spec: dict) -> dict:
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        num_gpu_blocks_override=spec["blocks"],
        max_model_len=int(spec.get("max_model_len", 448)),
        max_num_seqs=4,
        gpu_memory_utilization=float(spec.get("mem_util", 0.1)),
        seed=0,
    )
    if spec.get("offload") is not None:
        extra = {"spec_name": "TieredOffloadingSpec",
                 "spec_module_path": "tiering.integrations.vllm", **spec["offload"]}
        kwargs["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    out: dict = {"start_s": time.perf_counter() - t0, "rounds": [], "states": [], "corrupted": None}
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=1,
                            ignore_eos=True, detokenize=False)
    state_path = (spec.get("offload") or {}).get("state_path")
    for r, order in enumerate(spec["orders"]):
        results = []
        for i in order:
            p = spec["prompts"][i]
            t = time.perf_counter()
            res = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0]
            wall = time.perf_counter() - t
            c = res.outputs[0]
            lps = [float(d[tok].logprob).hex() for tok, d in zip(c.token_ids, c.logprobs, strict=True)]
            m = res.metrics
            ttft = None
            if m is not None and getattr(m, "first_token_latency", None):
                ttft = float(m.first_token_latency)
            results.append({"prompt": i, "tokens": list(c.token_ids), "logprobs": lps,
                            "cached": res.num_cached_tokens, "wall_s": wall, "ttft_s": ttft,
                            "prompt_tokens": len(p)})
        out["rounds"].append(results)
        if state_path:
            state = _read_state(state_path)
            out["states"].append(state)
            if spec.get("corrupt_after_round") == r:
                out["corrupted"] = corrupt_disk_only_blocks(state)
    try:  # let the engine shut its connector down (our manager removes its slab files)
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # best effort; the caller removes host_dir anyway
        print(f"engine shutdown: {exc!r}", file=sys.stderr)
    return out


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = run_engine(spec)
    Path(sys.argv[2]).write_text(json.dumps(result))
    # Skip interpreter teardown races of the engine's child processes.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
