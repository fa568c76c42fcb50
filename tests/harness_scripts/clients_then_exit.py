"""A CLI-style harness: one Anthropic Messages call and one Chat Completions call (each SDK finds
the gateway through its own *_BASE_URL variable), then exits with the code given (or dies of the
signal given, e.g. `TERM`)."""

import json
import os
import signal
import sys

import anthropic
import openai

ANSWER = json.loads(sys.argv[1])
a = anthropic.Anthropic(max_retries=0, default_headers={"X-Ledger-Agent-Id": "claude"})
m = a.messages.create(model="tiny", max_tokens=40, messages=[{"role": "user", "content": "hi"}],
                      extra_body={"constraint": ANSWER, "seed": 1})
o = openai.OpenAI(max_retries=0, default_headers={"X-Ledger-Agent-Id": "codex"})
c = o.chat.completions.create(model="tiny", max_tokens=40, messages=[{"role": "user", "content": "hi"}],
                              extra_body={"constraint": ANSWER, "seed": 2})
print(m.content[-1].text, c.choices[0].message.content, flush=True)
how = sys.argv[2]
if how.isdigit():
    sys.exit(int(how))
os.kill(os.getpid(), getattr(signal, "SIG" + how))
