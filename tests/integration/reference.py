"""Greedy reference outputs from vLLM's offline ``LLM.generate``, for comparing the fleet with.

Run as a script (vLLM needs the ``__main__`` guard): ``reference.py JOB OUT`` reads the JSON job
``{"model": PATH, "prompts": [[ids...], ...], "max_tokens": N}`` and writes
``{"token_ids": [[ids...], ...]}`` to OUT (vLLM logs to stdout, so not there).
The engine settings match what the test fleet's engines use (float32, as the tiny fleet runs).
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    job_path, out_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=job["model"], dtype="float32", max_model_len=2048, enforce_eager=True)
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params)
    with open(out_path, "w") as f:
        json.dump({"token_ids": [list(o.outputs[0].token_ids) for o in outputs]}, f)


if __name__ == "__main__":
    main()
