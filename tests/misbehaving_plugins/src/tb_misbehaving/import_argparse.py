"""Failure class 2: parses sys.argv at import with a required option, so argparse exits
(SystemExit 2) whatever program imported it."""

from tb_misbehaving import ACTIVE

if ACTIVE:
    import argparse

    _parser = argparse.ArgumentParser(prog="tb_misbehaving.import_argparse")
    _parser.add_argument("--mb-required-token", required=True)
    OPTIONS = _parser.parse_args()
