"""Helpers the tests share, importable by a name no other package uses (``from edgefl_testkit.mqtt import ...``).

Fixtures live in the conftest.py of the folder whose tests use them; plain functions and classes live here, one
module per subject, so a test imports them explicitly instead of from whichever conftest was imported last.
"""
