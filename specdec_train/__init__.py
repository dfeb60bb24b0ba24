"""Trainer of EAGLE-style draft heads for the `eagle` proposer (`python -m specdec_train --help`).

It lives outside the three services: it composes the verifier's engine (data) with the shared head model."""
