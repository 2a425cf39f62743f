"""What a program costs: FLOP and byte formulas (`cost`) and the resource model (`resources`)."""
