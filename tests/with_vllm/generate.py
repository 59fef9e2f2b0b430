"""Run a tiny local model through vLLM's ``LLM`` (CPU) and print what the end-to-end tests compare, as one JSON
line: greedy tokens with each step's two best candidates, and the logprob of every token of fixed sequences
(teacher forcing: both runs score the same tokens, so a near-tie in the greedy choice cannot hide a
difference).

    python tests/with_vllm/generate.py MODEL_DIR [--dp-shares N]

``--dp-shares N``: one-rank vLLM generates each of N data-parallel ranks' share of the prompts (`dp_share`, the
shares tests/with_vllm/generate_dp.py gives its ranks) as a batch of its own, one after the other: the batch
composition of an N-DP-rank run, which vLLM's CPU kernels see (a prompt's logprobs alone and in a larger batch
differ by batch-dependent rounding, enough to flip a greedy choice). The default, one share: every prompt in one
batch.

vLLM's MoE layers run symmring when ``SYMMRING_VLLM=1`` (the plugin entry point), vLLM's own experts otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

#: Greedy prompts (token ids) and tokens generated for each.
PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11], [300, 17, 42, 5, 77])
MAX_TOKENS = 8
#: Sequences every run scores (seeded, the same in every run).
SCORED, SCORED_LEN = 3, 24
#: ``vllm.LLM`` arguments of every run (generate_dp.py adds its expert parallelism).
ENGINE_ARGS = dict(skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128, max_num_seqs=4,
                   max_num_batched_tokens=128, enforce_eager=True, kv_cache_memory_bytes=64 << 20, seed=0)


def dp_share(rank: int, size: int) -> list[int]:
    """Indices into `PROMPTS` that data-parallel rank ``rank`` of ``size`` generates (round robin)."""
    return list(range(rank, len(PROMPTS), size))


def scored_sequences(vocab: int):
    import torch
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (SCORED, SCORED_LEN), generator=g).tolist()


def greedy_rows(llm, indices: list[int]) -> list:
    """``(prompt index, tokens, each step's two best (token, logprob))`` of `PROMPTS` ``indices``, generated as one
    batch."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    outs = llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[i]) for i in indices],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False, logprobs=2))
    return [(i, list(o.outputs[0].token_ids),
             [sorted(((t, lp.logprob) for t, lp in step.items()), key=lambda c: -c[1])[:2]
              for step in o.outputs[0].logprobs]) for i, o in zip(indices, outs)]


def main(path: str, dp_shares: int) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=path, **ENGINE_ARGS)
    batches = [dp_share(rank, dp_shares) for rank in range(dp_shares)]
    rows = sorted(row for batch in batches if batch for row in greedy_rows(llm, batch))
    vocab = llm.llm_engine.model_config.get_vocab_size()
    sequences = scored_sequences(vocab)
    scored = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences],
                          SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, prompt_logprobs=0))
    result = dict(
        tokens=[r[1] for r in rows], top2=[r[2] for r in rows], batches=batches,
        scores=[[step[tok].logprob for step, tok in zip(o.prompt_logprobs[1:], seq[1:])]
                for o, seq in zip(scored, sequences)])
    print("RESULT " + json.dumps(result), flush=True)
    end(llm)


def end(llm) -> None:
    """Shut vLLM's engine down, then leave without the interpreter's teardown: with the engine core in its own
    process, vLLM 0.32 (CPU) aborted at interpreter exit in about 1 of 3 to 1 of 7 runs ("terminate called
    without an active exception", status -6) after its client's cleanup, the results already printed; the
    same with the test's code before the shares. The results are complete here, so the exit status says only
    whether they were made."""
    engine = getattr(llm, "llm_engine", None)
    shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None) or getattr(engine, "shutdown", None)
    if shutdown is not None:
        shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--dp-shares", type=int, default=1, metavar="N",
                        help="generate each of N data-parallel ranks' share of the prompts as a batch of its own")
    args = parser.parse_args()
    if args.dp_shares < 1:
        parser.error(f"--dp-shares must be at least 1, got {args.dp_shares}")
    main(args.model_dir, args.dp_shares)
