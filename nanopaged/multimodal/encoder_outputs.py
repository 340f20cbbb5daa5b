"""The runner's half of the encoder cache: each image's encoder output by content hash, and the step's rows.

The scheduler (core/encoder_cache.py) decided which images this step encodes and which entries were given
up; here, before the forward pass, the given-up tensors are dropped, the new images encoded (one call each,
so an image's rows never depend on what is encoded beside it), and every row of the step that holds an image
token gets its encoder row in place of the token's embedding: the rows of a span a chunk cuts through come
from the cache in the next step. A multimodal-rotary model (Qwen2.5-VL) also gets its three rows of positions.
"""
from __future__ import annotations

import time

import torch


class EncoderOutputs:
    def __init__(self, model) -> None:
        self.model = model
        self.outputs: dict[str, torch.Tensor] = {}     # content hash -> (num_embeds, hidden)
        self.seconds = 0.0                              # spent in the encoder

    def __call__(self, out, inputs) -> None:
        for key in out.encoder_frees:
            self.outputs.pop(key, None)
        for request, i in out.encoder_inputs:
            self._output(request.encoder_inputs[i])
        spans = list(self._spans(out, inputs.meta))
        self._embed(inputs, spans)
        if getattr(self.model, "mrope", False):
            inputs.positions = mrope_positions(inputs.positions, spans)

    def _output(self, image) -> torch.Tensor:
        """The image's rows, encoded now if they are not held: the step that should have encoded them may
        have failed after the scheduler counted them in (two requests with one image: encoded once)."""
        if image.hash not in self.outputs:
            start = time.perf_counter()
            self.outputs[image.hash] = self.model.encode_image(image.data.data)
            self.seconds += time.perf_counter() - start
        return self.outputs[image.hash]

    @staticmethod
    def _spans(out, meta):
        """(request, first row, first position, end position) of each request in the step."""
        row = 0
        for (request, num_new), seq_len in zip(out.scheduled, meta.seq_lens_list):
            yield request, row, seq_len - num_new, seq_len
            row += num_new

    def _embed(self, inputs, spans) -> None:
        rows, pieces = [], []
        for request, row, start, end in spans:
            for image in request.encoder_inputs:
                taken = [(image.offset + off, j) for j, off in enumerate(image.data.embed_positions)
                         if start <= image.offset + off < end]
                if taken:
                    rows += [row + position - start for position, _ in taken]
                    pieces.append(self._output(image)[[j for _, j in taken]])
        if rows:
            embeds = self.model.embed_input_ids(inputs.input_ids)
            embeds[rows] = torch.cat(pieces).to(embeds.dtype)
            inputs.inputs_embeds = embeds


def mrope_positions(positions: torch.Tensor, spans) -> torch.Tensor:
    """(3, rows): a prompt's multimodal positions where its processor gave them, index + delta past them
    (a text-only request: its index on all three rows, as transformers' get_rope_index gives)."""
    out = positions.expand(3, -1).clone()
    for request, row, start, end in spans:
        prompt = request.extension_fields.get("multimodal")
        if prompt is None or prompt.mrope_positions is None:
            continue
        in_prompt = max(min(end, len(prompt.token_ids)) - start, 0)
        out[:, row:row + in_prompt] = prompt.mrope_positions[:, start:start + in_prompt]
        out[:, row + in_prompt:row + end - start] += prompt.mrope_delta
    return out
