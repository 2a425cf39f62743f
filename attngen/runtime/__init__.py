"""Loading, launching and replaying generated kernels: `kernel` (load, Kernel), the disk `cache`, `launch`,
`replay`, argument checks (`arguments`), the tuned config tables (`tables`, `keys`), call `plans`, `autograd`
and the custom `ops`."""
