import sys, time
from experiments.lancet_eval import paper_config, MODELS
from jaxmoe.parallel import build_mesh
from jaxmoe.train.scheduled import capture_train_step
from scheduling.optimize import batch_inputs, build_report, cost_model, plan
from scheduling.policy import SchedulePolicy
layers, width, gpus, profile = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
config = paper_config(layers, width, gpus)
mesh = build_mesh(config.parallel)
program, sharded = capture_train_step(config, mesh)
batch = batch_inputs(program, sharded.batch_argnums)
for name in sys.argv[5].split(","):
    policy = SchedulePolicy(name=name, profile=profile)
    cost = cost_model(policy, mesh)
    t = time.perf_counter()
    p = plan(program, policy, cost, batch)
    r = build_report(p, cost, policy, program)
    a2a = sum(c.estimated_seconds - c.overlap_seconds for c in r.collectives if c.kind == "all_to_all")
    print(f"{name}: {time.perf_counter()-t:.1f}s step {r.step_seconds*1e3:.2f} exposed {r.exposed_communication_seconds*1e3:.2f} a2a {a2a*1e3:.2f} ideal {r.ideal_step_seconds*1e3:.2f} base {r.baseline_step_seconds*1e3:.2f} parts {[q.chunks for q in r.partitions]}", flush=True)
