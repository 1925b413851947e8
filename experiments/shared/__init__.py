"""What several experiment commands use: ``spread`` (median and range of repeated timings,
paired per-round ratios), ``results_file`` (command lines, sections kept from an earlier
run), ``device_process`` (a function called in a fresh process with N CPU devices)."""
