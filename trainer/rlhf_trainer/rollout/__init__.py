"""Generation: the engine protocols (`base`), the engines, the disaggregated fleet, colocated
engines, partial rollouts and weight sync."""
