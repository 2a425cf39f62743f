"""Loading, launching and replaying generated kernels: `kernel` (load, Kernel), its launch parts beyond the
forward (`parts`), the disk `cache`, `launch`, `replay`, argument checks (`arguments`), the tuned config tables
and their lookup (`tables`, `keys`), the one cache of call `plans`, `autograd`, the custom `ops` and the kernels
they name (`registry`)."""
