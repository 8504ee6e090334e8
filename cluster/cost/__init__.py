"""Money: prices and estimates, the per-run and daily budgets and their reservations, the spend ledger."""
