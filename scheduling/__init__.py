"""The scheduling layer: rewrites a whole per-device training step (a jaxpr) so that
collectives run asynchronously behind computation. Works on jaxprs alone; it knows
nothing of Flax or of jaxmoe."""
