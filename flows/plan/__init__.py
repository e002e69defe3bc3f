"""The plan of one run, decided once before any stage runs (build.make_plan): the form's parameters
(params), the operator's boundary (boundary), what defines the run (identity), what its folder says
will happen (outlook), where its files live (layout), its memory and disk (sizes), time and cost
(estimate), the budget's approval (approval) and how it was made (provenance)."""
