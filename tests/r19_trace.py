"""trace_r19_01 of seed 002 (§15.6.2 / §15.9 / §15.10): the request token data shared by the tests
that build it (test_governance, test_tree_derived through it, test_repair_record).

e1 the task prompt and first inspection, e2 the refused malformed edit, e3 the schema query naming
a private fixture path, e4 the corrected edit, e5 the harness's test summary, e6 the final
summary -- one growing context.  The prompt and e3's output carry the private path that the
``path_redaction@v1`` derivation replaces with a placeholder.
"""

from __future__ import annotations

R19_PATH = [51234, 51235, 51236]  # the private fixture path's tokens
PLACEHOLDER = [777]
R19_PROMPT = [10, 11] + R19_PATH + [12]

# request id -> (input_ids, output_ids, generator), in recording order
R19_REQUESTS: dict[str, tuple[list[int], list[int], str]] = {
    "e1": (R19_PROMPT, [20, 21], "policy"),
    "e2": (R19_PROMPT + [20, 21, 30], [40, 41], "policy"),  # the refused edit (stays context)
    "e3": (R19_PROMPT + [20, 21, 30, 40, 41, 31], [50] + R19_PATH, "policy"),  # schema query naming the path
    "e4": (R19_PROMPT + [20, 21, 30, 40, 41, 31, 50] + R19_PATH + [32], [60, 61], "policy"),  # corrected edit
    "e5": (R19_PROMPT + [20, 21, 30, 40, 41, 31, 50] + R19_PATH + [32, 60, 61, 33], [70], "harness"),  # test summary
    "e6": (R19_PROMPT + [20, 21, 30, 40, 41, 31, 50] + R19_PATH + [32, 60, 61, 33, 70, 34], [80, 81], "policy"),
}


def redact(tokens: list[int]) -> list[int]:
    """``tokens`` with every occurrence of the private path replaced by the placeholder."""
    out, i = [], 0
    while i < len(tokens):
        if tokens[i:i + len(R19_PATH)] == R19_PATH:
            out += PLACEHOLDER
            i += len(R19_PATH)
        else:
            out.append(tokens[i])
            i += 1
    return out
