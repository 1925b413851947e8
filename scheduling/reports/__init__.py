"""What a schedule did and what a trace of it measured: the schedule report (``report``,
built by ``describe``; its timeline as a Chrome trace or a Gantt chart: ``chrome_trace``,
``gantt``), a profiler trace read and compared with it (``measured_trace``), and the op
costs that trace gives back to the simulator (``traced_costs``)."""
