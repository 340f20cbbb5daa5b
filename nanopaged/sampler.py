"""The sampler: one next token per sampling row, from the last position's logits.

Greedy rows (temperature 0) take the argmax, which is what Hugging Face's greedy
`generate` does, ties to the lowest id included. Other rows sample from
softmax(logits / temperature). A request with its own `seed` draws from its own
generator, so its tokens do not depend on which other requests share the batch; the rest
share the engine's generator, seeded by `EngineConfig.seed`.
The returned logprob is the model's log-probability of the chosen token (raw logits,
before temperature), summed by the engine into `cumulative_logprob`.
"""
from __future__ import annotations

import torch

from nanopaged.request import Request


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[float]]:
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        temps = [r.sampling_params.temperature for r in requests]
        random_rows = [i for i, t in enumerate(temps) if t > 0]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            t = torch.tensor([temps[i] for i in random_rows], device=logits.device)
            probs = torch.softmax(logits[idx] / t[:, None], dim=-1)
            for j, row in enumerate(random_rows):
                g = self._generator(requests[row])
                tokens[row] = torch.multinomial(probs[j], 1, generator=g)[0]
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
        return tokens.tolist(), logprobs.tolist()

    def _generator(self, request: Request) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self.generator
        g = self.request_generators.get(request.request_id)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(seed)
            self.request_generators[request.request_id] = g
        return g

    def free_request(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)
