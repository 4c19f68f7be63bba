# llama.cpp peer for `dspark bench decode`: greedy decode tokens/s on a GGUF, batch 1.
# Usage: python3 llama_cpp_decode.py MODEL.gguf THREADS PROMPT_LEN TOKENS  -> one JSON line.
import json, sys, time
import numpy as np
import llama_cpp

path, threads, prompt_len, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads,
                      n_ctx=prompt_len + tokens + 16, n_batch=512, logits_all=False, verbose=False)
vocab = llm.n_vocab()
prompt = [1000 + (i * 7919 + 104729) % (vocab - 1000) for i in range(prompt_len)]
llm.eval(prompt)
def step(tok):
    llm.eval([tok])
    return int(np.argmax(llm.scores[llm.n_tokens - 1]))
tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
tok = step(tok)  # warm-up
t0 = time.perf_counter()
for _ in range(tokens):
    tok = step(tok)
dt = time.perf_counter() - t0
print(json.dumps({"tok_s": tokens / dt}))
