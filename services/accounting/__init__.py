"""The accounting service: the per-task ledger (cost, SLA), budgets' settlement, finance reports."""
