"""`pagoda serve` on a Yuan2 whose embedding has more rows than its tokenizer has pieces (as the real
checkpoints do: 135,040 rows, 134,958 pieces): ids in between, sampled by the model or sent by a
client, used to end the engine core (`IndexError: piece id is out of range`) and leave the server
answering 503. The served model's LM head makes greedy decoding land on such ids about half the
time (`tests/conftest.build_wide_yuan`); the reference is the offline engine on the same folder.
"""

from __future__ import annotations

import httpx
from e2e_helpers import API_KEY, MODEL

from pagoda import LLM, SamplingParams

PROMPTS = ["Hello", "Once upon a time", "1, 2, 3,"]


def test_ids_without_a_tokenizer_piece_leave_the_server_healthy(padding_yuan, launch_server):
    llm = LLM(model=padding_yuan, max_model_len=256, num_gpu_blocks_override=64, seed=0)
    reference = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    pieces = len(llm.get_tokenizer())
    assert any(t >= pieces for o in reference for t in o.outputs[0].token_ids), "the model must sample one"
    prompt_with_one = [100, 135000]
    expected_text = llm.get_tokenizer().decode([100])
    del llm

    server = launch_server("--model", padding_yuan, "--max-model-len", "256")
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:

        def complete(prompt, stream=False):
            body = {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0,
                "ignore_eos": True,
                "stream": stream,
            }
            if not stream:
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events
            import json

            return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])

        for prompt, out in zip(PROMPTS, reference):
            assert complete(prompt) == out.outputs[0].text
            assert complete(prompt, stream=True) == out.outputs[0].text
        # A prompt holding such an id is valid (it is a row of the model); one past the rows is not.
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt_with_one, "max_tokens": 1})
        assert r.status_code == 200, r.text
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": [100, 135040], "max_tokens": 1})
        assert r.status_code == 400 and "135040" in r.json()["error"]["message"]
        assert "[0, 135040)" in r.json()["error"]["message"]
        r = http.post("/detokenize", json={"model": MODEL, "tokens": prompt_with_one})
        assert r.status_code == 200 and r.json()["prompt"] == expected_text
        assert http.get("/health").status_code == 200
        # The next request is answered exactly as before.
        assert complete(PROMPTS[0]) == reference[0].outputs[0].text
