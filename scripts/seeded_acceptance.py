"""Acceptance of seeded (coupled, Gumbel-max) vs unseeded (rejection) verification on the default models.

    PYTHONPATH=. python scripts/seeded_acceptance.py [--max-tokens 48] [--k 4]

Prints, per drafter and mode, drafted and accepted tokens and the acceptance rate at T = 0.8.
"""

from __future__ import annotations

import argparse
import time

import torch

from shared.model.build import CacheConfig
from shared.model.loader import load_model, load_tokenizer
from shared.sampling import SamplingParams
from shared.settings import default_draft_model, default_target_model
from specdec_bench.engine_bench import chat_ids
from specdec_bench.prompts import GENERAL_PROMPTS, QUOTING_PROMPTS
from specdec_local.builder import build_engine, make_draft_model_drafter
from verifier_service.engine import EngineConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=2, help="of each kind (general, quoting)")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    target_name = default_target_model()
    target = load_model(target_name, torch.float32, "cpu")
    draft = load_model(default_draft_model(), torch.float32, "cpu")
    tok = load_tokenizer(target_name)
    prompts = [chat_ids(tok, p) for p in GENERAL_PROMPTS[: args.prompts] + QUOTING_PROMPTS[: args.prompts]]
    config = EngineConfig(num_speculative_tokens=args.k, max_num_seqs=len(prompts), adaptive_k=False)
    cache = CacheConfig()
    for name in ("draft-model", "ngram"):
        for seeded in (False, True):
            drafter = make_draft_model_drafter(*draft, config, cache) if name == "draft-model" else "ngram"
            engine = build_engine(target, drafter, config, cache)
            for i, prompt in enumerate(prompts):
                params = SamplingParams(
                    temperature=0.8, seed=1000 + i if seeded else None, max_tokens=args.max_tokens, ignore_eos=True
                )
                engine.add_request(f"r{i}", prompt, params)
            start = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            s = engine.stats
            print(
                f"{name:12s} {'seeded' if seeded else 'unseeded':9s} drafted={s.drafted_tokens:5d} "
                f"accepted={s.accepted_tokens:5d} acceptance={s.acceptance_rate:.3f} "
                f"tokens_per_draft_round={s.tokens_per_draft_round:.2f} seconds={time.perf_counter() - start:.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
