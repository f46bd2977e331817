"""Engine outputs -> OpenAI response bodies and stream chunks (plain dicts, JSON-ready)."""

from __future__ import annotations

from functools import lru_cache

from specserve.outputs import RequestOutput, SpecStats, TextPiece, TokenLogprob
from specserve.server import tools
from specserve.server.protocol import ChatCompletionResponse, CompletionResponse, SpecUsage, Usage
from specserve.tokenizer import Tokenizer

# JSON has no -inf; a token the model rules out entirely reports this instead (as vLLM does).
_MIN_LOGPROB = -9999.0


def provenance_fields(pieces: list[TextPiece], spec: SpecStats) -> dict:
    """The provenance extension of a choice: its text as [text, source] pairs, token by token
    (source one of outputs.TOKEN_SOURCES), and the request's speculation figures so far."""
    return {"provenance": [[p.text, p.source] for p in pieces], "speculation": spec.as_dict()}


class Renderer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ---- whole responses ---------------------------------------------------------------------------

    def completion(self, job, echo: list[str]) -> dict:
        choices = []
        for c in job.choices:
            o = c.last.outputs[0]
            prefix = echo[c.prompt_index]
            choices.append({"index": c.index, "text": prefix + o.text,
                            "logprobs": None if o.logprobs is None else self.completion_logprobs(o.logprobs, len(prefix)),
                            "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
        body = CompletionResponse(id=job.request_id, created=job.created, model=job.model, choices=choices,
                                  usage=self.usage(job)).model_dump(exclude_none=False)
        return self._with_provenance(job, body)

    def chat(self, job) -> dict:
        choices = []
        for c in job.choices:
            o = c.last.outputs[0]
            message, finish = {"role": "assistant", "content": o.text}, o.finish_reason
            if job.tools is not None:
                message, finish = tools.reply_message(job.tools, o.text, finish)
            choices.append({"index": c.index, "message": message,
                            "logprobs": None if o.logprobs is None else {"content": self.chat_logprobs(o.logprobs)},
                            "finish_reason": finish, "stop_reason": o.stop_reason})
        body = ChatCompletionResponse(id=job.request_id, created=job.created, model=job.model, choices=choices,
                                      usage=self.usage(job)).model_dump()
        return self._with_provenance(job, body)

    def _with_provenance(self, job, body: dict) -> dict:
        """The provenance extension's fields on each choice of a whole response (the response
        models stay OpenAI's, so they are added after dumping)."""
        if job.provenance:
            for choice, c in zip(body["choices"], job.choices):
                choice |= provenance_fields(c.pieces, c.last.spec)
        return body

    def usage(self, job) -> Usage:
        lasts = [c.last for c in job.choices if c.last is not None]
        completion = sum(len(o.outputs[0].token_ids) for o in lasts)
        prompt = sum(len(ids) for ids, _ in job.prompts)  # each prompt once, however many choices
        spec = SpecStats.total(o.spec for o in lasts)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     speculative=SpecUsage(num_drafted_tokens=spec.num_drafted, num_accepted_tokens=spec.num_accepted,
                                           acceptance_rate=round(spec.acceptance_rate, 4),
                                           mean_accepted_length=round(spec.mean_accepted_length, 4),
                                           num_target_passes=spec.num_target_passes))

    # ---- stream chunks -----------------------------------------------------------------------------

    def completion_chunk(self, job, c, out: RequestOutput, prefix: str) -> dict:
        o = out.outputs[0]
        choice = {"index": c.index, "text": prefix + out.new_text, "logprobs": None,
                  "finish_reason": o.finish_reason if out.finished else None}
        if o.logprobs is not None:
            choice["logprobs"] = self.completion_logprobs(o.logprobs[c.logprobs_sent:], 0)
            c.logprobs_sent = len(o.logprobs)
        if out.finished:
            choice["stop_reason"] = o.stop_reason
        if job.provenance:
            choice |= provenance_fields(out.new_pieces, out.spec)
        return {"id": job.request_id, "object": "text_completion", "created": job.created, "model": job.model,
                "choices": [choice]}

    def chat_chunk(self, job, c, out: RequestOutput, first: bool) -> dict:
        o = out.outputs[0]
        delta: dict = {"role": "assistant"} if first else {}
        finish = o.finish_reason if out.finished else None
        if c.tool_parser is None:
            delta["content"] = out.new_text
        else:
            calls, finish = tools.stream_delta(c.tool_parser, out.new_text, finish)
            delta |= calls
        choice = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": finish}
        if o.logprobs is not None:
            choice["logprobs"] = {"content": self.chat_logprobs(o.logprobs[c.logprobs_sent:])}
            c.logprobs_sent = len(o.logprobs)
        if job.provenance:
            choice |= provenance_fields(out.new_pieces, out.spec)
        return {"id": job.request_id, "object": "chat.completion.chunk", "created": job.created, "model": job.model,
                "choices": [choice]}

    def usage_chunk(self, job) -> dict:
        return {"id": job.request_id, "object": job.chunk_object, "created": job.created, "model": job.model, "choices": [],
                "usage": self.usage(job).model_dump()}

    # ---- log probabilities -------------------------------------------------------------------------

    def completion_logprobs(self, logprobs: list[TokenLogprob], offset: int) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for lp in logprobs:
            text = self.token_text(lp.token_id)
            tokens.append(text)
            values.append(max(lp.logprob, _MIN_LOGPROB))
            tops.append({self.token_text(t): max(v, _MIN_LOGPROB) for t, v in lp.top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, logprobs: list[TokenLogprob]) -> list[dict]:
        def entry(token_id: int, value: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": max(value, _MIN_LOGPROB), "bytes": list(text.encode("utf-8"))}

        return [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]
