"""Differential tests of the recipe's input side against deepseek-recipe 0.2.0 (the oracle, a test dependency).

`conftest.py` holds the harness (run a request through both, compare everything that reaches the model) and
the hypothesis strategies that generate requests for each API.
"""
