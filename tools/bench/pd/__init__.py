"""`tiercache bench pd`: the prefill/decode hand-off's time to first token, and many hand-offs counted."""
