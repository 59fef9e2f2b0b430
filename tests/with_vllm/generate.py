"""Run a tiny local model through vLLM's ``LLM`` (CPU) and print what the end-to-end tests compare, as one JSON
line: greedy tokens with each step's two best candidates, and the logprob of every token of fixed sequences
(teacher forcing: both runs score the same tokens, so a near-tie in the greedy choice cannot hide a
difference).

    python tests/with_vllm/generate.py MODEL_DIR

vLLM's MoE layers run symmring when ``SYMMRING_VLLM=1`` (the plugin entry point), vLLM's own experts otherwise.
"""

from __future__ import annotations

import json
import sys

#: Greedy prompts (token ids) and tokens generated for each.
PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11], [300, 17, 42, 5, 77])
MAX_TOKENS = 8
#: Sequences every run scores (seeded, the same in every run).
SCORED, SCORED_LEN = 3, 24


def scored_sequences(vocab: int):
    import torch
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (SCORED, SCORED_LEN), generator=g).tolist()


def main(path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=128, enforce_eager=True, kv_cache_memory_bytes=64 << 20, seed=0)
    greedy = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                          SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False, logprobs=2))
    vocab = llm.llm_engine.model_config.get_vocab_size()
    sequences = scored_sequences(vocab)
    scored = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences],
                          SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, prompt_logprobs=0))
    result = dict(
        tokens=[list(o.outputs[0].token_ids) for o in greedy],
        top2=[[sorted(((t, lp.logprob) for t, lp in step.items()), key=lambda c: -c[1])[:2]
               for step in o.outputs[0].logprobs] for o in greedy],
        scores=[[step[tok].logprob for step, tok in zip(o.prompt_logprobs[1:], seq[1:])]
                for o, seq in zip(scored, sequences)])
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
