"""The vLLM side of `specdec_bench.peer_bench`, run inside vLLM's own venv (`.cache/peers/vllm-venv`): it imports
vllm and the standard library only, never this repository.

Reads a JSON job (model folder, dtype, optional draft model and k, the prompts as token ids, the batch sizes,
max_tokens, repetitions), loads one `vllm.LLM`, generates greedily with `ignore_eos` (one warm-up pass first,
so compilation and first-touch costs stay out of the timings), and writes a JSON result: per batch size the
seconds of each repetition, the generated token ids, and the speculative-decoding counters when a draft ran.

    python specdec_bench/peer_vllm.py JOB.json RESULT.json                     # one process, every batch size
    python specdec_bench/peer_vllm.py --serve JOB.json COMMANDS_FD RESULTS_FD  # peer_bench's interleaved worker
"""

from __future__ import annotations

import json
import os
import sys
import time


def make_llm(job: dict):
    from vllm import LLM

    kwargs: dict = dict(
        model=job["model"],
        tokenizer=job["tokenizer"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        max_num_seqs=max(job["batches"]),
        seed=0,
        # An explicit KV cache size: vLLM's CPU worker otherwise asks for a fraction of the NUMA node's memory,
        # which a shared machine may not have free.
        kv_cache_memory_bytes=job.get("kv_cache_bytes", 1 << 30),
        enforce_eager=job.get("enforce_eager", False),
    )
    if job.get("draft"):
        kwargs["speculative_config"] = {
            "method": "draft_model",
            "model": job["draft"],
            "num_speculative_tokens": job["k"],
        }
        # Its drafted / accepted counters (LLM.get_metrics) exist only with stats on; the rows without a draft
        # keep vLLM's offline default (off) so they pay no logging.
        kwargs["disable_log_stats"] = False
    return LLM(**kwargs)


def generate(llm, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds to generate `max_tokens` for every prompt, `batch` prompts per `generate` call."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = [TokensPrompt(prompt_token_ids=ids) for ids in prompts[i : i + batch]]
        for out in llm.generate(group, params, use_tqdm=False):
            outputs.append(list(out.outputs[0].token_ids))
    return time.perf_counter() - start, outputs


def spec_counters(llm) -> dict:
    """vLLM's own speculative-decoding counters (drafted and accepted tokens), when it exposes them."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - older or newer APIs: the counters are informative only
        return {}
    found = {}
    for metric in metrics:
        if metric.name in ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens"):
            found[metric.name.split(":")[1]] = getattr(metric, "value", None)
    return found


def load(job: dict):
    """The LLM, warmed up, the seconds its load took, and its timed pass per batch size."""
    start = time.perf_counter()
    llm = make_llm(job)
    load_s = time.perf_counter() - start
    prompts, max_tokens = job["prompts"], job["max_tokens"]
    generate(llm, prompts[: max(job["batches"])], max(job["batches"]), max_tokens)  # warm-up

    def run_pass(batch: int) -> dict:
        runs = [generate(llm, prompts, batch, max_tokens) for _ in range(job["reps"])]
        return {"seconds": [s for s, _ in runs], "outputs": runs[-1][1]}

    return llm, load_s, run_pass


def serve(job: dict, commands_fd: int, results_fd: int) -> None:
    """The interleaved mode's worker (the loop of specdec_bench/peer_workers.py's serve, which this file may not
    import): ready once warmed up, one timed pass per {"batch": B}, the speculative counters on {"finish": true}."""
    with os.fdopen(commands_fd) as commands, os.fdopen(results_fd, "w") as results:
        llm, load_s, run_pass = load(job)
        results.write(json.dumps({"ready": True, "load_s": load_s}) + "\n")
        results.flush()
        for line in commands:
            message = json.loads(line)
            answer = {"spec": spec_counters(llm)} if message.get("finish") else run_pass(int(message["batch"]))
            results.write(json.dumps(answer) + "\n")
            results.flush()
            if message.get("finish"):
                return


def main(argv: list[str]) -> int:
    if argv[1] == "--serve":
        with open(argv[2]) as f:
            serve(json.load(f), int(argv[3]), int(argv[4]))
        return 0
    with open(argv[1]) as f:
        job = json.load(f)
    llm, load_s, run_pass = load(job)
    result: dict = {"load_s": load_s, "runs": {str(batch): run_pass(batch) for batch in job["batches"]}}
    result["spec"] = spec_counters(llm)
    with open(argv[2], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
