"""Write ``data/chat_golden.json``: token ids of chat conversations as vLLM's renderer makes them
(``transformers`` ``apply_chat_template`` with ``add_generation_prompt``, tokenised without added
special tokens) and of plain prompts (``encode`` with special tokens), for the tiny model's
tokenizer and two more templates that use the environment's extras (loop controls, ``tojson``,
``raise_exception``, special-token variables). Run with the vLLM venv's interpreter::

    /root/.cache/bear/vllm-venv/bin/python tests/tokenizer/make_golden.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "services" / "vllm_instance"))
from tiny_model import write_tokenizer  # noqa: E402

TEMPLATES = {
    "loopcontrols-tojson": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
        "[{{ m['role'] | upper }}] {{ m['content'] | tojson }}\n{% endfor %}"
        "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
    ),
    "raise-on-bad-role": (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
        "{{ raise_exception('bad role') }}{% endif %}  {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    ),
}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? <tags> & \"quotes\" ü€"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}],
    [{"role": "user", "content": "  leading and trailing spaces  \n\n"}],
]
PROMPTS = ["plain text", "", "ünïcödé ✓ and <|im_start|> special", "x" * 500]


def main() -> None:
    from transformers import AutoTokenizer

    out = []
    with tempfile.TemporaryDirectory() as d:
        write_tokenizer(Path(d))
        base = json.loads((Path(d) / "tokenizer_config.json").read_text())
        for name, template in [("tiny", base["chat_template"]), *TEMPLATES.items()]:
            cfg = {**base, "chat_template": template, "bos_token": "<|endoftext|>"}
            (Path(d) / "tokenizer_config.json").write_text(json.dumps(cfg))
            tok = AutoTokenizer.from_pretrained(d)
            for conv in CONVERSATIONS:
                flat = [{**m, "content": "\n".join(p["text"] for p in m["content"])} if isinstance(m["content"], list)
                        else m for m in conv]  # vLLM's "string" content format
                ids = tok.apply_chat_template(flat, add_generation_prompt=True, tokenize=True, return_dict=False)
                out.append({"template": name, "chat_template": template, "messages": conv, "ids": list(ids)})
            for p in PROMPTS:
                out.append({"template": name, "chat_template": template, "prompt": p,
                            "ids": tok.encode(p, add_special_tokens=True)})
    (HERE / "data" / "chat_golden.json").write_text(json.dumps(out))
    print(f"{len(out)} cases")


if __name__ == "__main__":
    main()
