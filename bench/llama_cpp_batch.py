"""llama.cpp on the fixed workload through its low-level API (llama-cpp-python's ctypes binding).

`Llama.generate` decodes one sequence at a time, which would understate llama.cpp on a batch.
Here every sequence has its own `seq_id` in one shared context, as llama.cpp's own batched
example does: the prompts go in batches of up to `n_batch` tokens (logits only at each prompt's
last token), then each step decodes one token of every sequence in one `llama_decode`, greedy
(argmax of each sequence's logits). The output tokens/s counts the whole run, prompts included,
as `strata_offline.fixed` does. `extra_bufts` False keeps llama.cpp off its AMX weight repack
(`use_extra_bufts`): with it, llama-cpp-python 0.3.36 built from PyPI segfaults in the first
`llama_decode` on this Xeon (Sapphire Rapids AMX), through its high-level API as well.

    python bench/llama_cpp_batch.py MODEL.gguf [--threads 2] [--num 32] [--input-len 128]
        [--output-len 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import random_prompts  # noqa: E402


class LlamaCppBatch:
    """One model and one context of `n_seq` sequences x `seq_len` positions each."""

    def __init__(self, path: str, threads: int, n_seq: int = 32, seq_len: int = 384,
                 n_batch: int = 512, extra_bufts: bool = False) -> None:
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        mparams.use_extra_bufts = extra_bufts
        self.model = lc.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_seq * seq_len
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the context")
        self.n_batch = n_batch
        self.batch = lc.llama_batch_init(max(n_batch, n_seq), 0, 1)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """Decode (token, position, seq_id, wants logits) entries in one `llama_decode`."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if logits else 0
        b.n_tokens = len(entries)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, i: int) -> int:
        ptr = self.lc.llama_get_logits_ith(self.ctx, i)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def generate(self, prompts: list[list[int]], n_out: int) -> list[list[int]]:
        """Greedy `n_out` tokens after each prompt, all sequences together."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        outs: list[list[int]] = [[] for _ in prompts]
        pending: list[tuple[int, int, int, bool]] = []  # prompt tokens, in n_batch batches
        for seq, prompt in enumerate(prompts):
            for pos, tok in enumerate(prompt):
                last = pos == len(prompt) - 1
                pending.append((tok, pos, seq, last))
                if len(pending) == self.n_batch or (last and seq == len(prompts) - 1):
                    self._decode(pending)
                    for i, (_, _, s, wants) in enumerate(pending):
                        if wants:
                            outs[s].append(self._argmax(i))
                    pending = []
        self.token_times = [time.perf_counter()]  # when each step's tokens were sampled
        for _ in range(n_out - 1):
            self._decode([(outs[s][-1], len(prompts[s]) + len(outs[s]) - 1, s, True)
                          for s in range(len(prompts))])
            for s in range(len(prompts)):
                outs[s].append(self._argmax(s))
            self.token_times.append(time.perf_counter())
        return outs

    def single(self, prompt: list[int], n_out: int) -> float:
        """One stream: decode tokens/s after the first token (as `strata_offline.fixed`)."""
        self.generate([prompt], n_out)
        t = self.token_times
        return (len(t) - 1) / (t[-1] - t[0])

    def fixed(self, prompts: list[list[int]], n_out: int) -> tuple[float, list[list[int]]]:
        """(output tokens/s of the whole run, the tokens)."""
        t0 = time.perf_counter()
        outs = self.generate(prompts, n_out)
        return sum(map(len, outs)) / (time.perf_counter() - t0), outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--amx", action="store_true", help="let llama.cpp repack for AMX")
    a = ap.parse_args()
    runner = LlamaCppBatch(a.model, a.threads, n_seq=a.num, extra_bufts=a.amx)
    prompts = random_prompts(a.num, a.input_len, runner.n_vocab, 0)
    tok_s, _ = runner.fixed(prompts, a.output_len)
    runner.close()
    print(json.dumps({"tokens_per_s": tok_s}))


if __name__ == "__main__":
    main()
