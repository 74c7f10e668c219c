"""Make the live engine emit a given text: the tiny random model never writes tool-call markup or
JSON by itself. The engine still runs the request for real (prefill, decode rounds, cancellation,
stats); only the emitted token ids are replaced by the script's, and the end is reported as EOS."""

from __future__ import annotations

import contextlib
import dataclasses


@contextlib.contextmanager
def scripted_output(live_server, text: str):
    engine = live_server.bridge.engine
    script = engine.tokenizer.encode(text)
    real_generate = engine.generate

    def generate(req):
        sampling = dataclasses.replace(req.sampling, max_tokens=len(script), ignore_eos=True, stop_token_ids=())
        steps = real_generate(dataclasses.replace(req, sampling=sampling))  # shares req.cancel

        def run():
            pos = 0
            try:
                for step in steps:
                    ids = script[pos : pos + len(step.token_ids)]
                    pos += len(ids)
                    reason = "stop" if step.finish_reason == "length" else step.finish_reason
                    yield dataclasses.replace(step, token_ids=ids, finish_reason=reason, logprobs=None)
            finally:
                steps.close()

        return run()

    engine.generate = generate
    try:
        yield script
    finally:
        live_server.wait_idle()
        del engine.generate  # back to the class's method
