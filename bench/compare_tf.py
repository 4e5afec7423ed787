"""compare.py's tf-privacy worker: runs in the TensorFlow venv of ``make bench-tf`` (TensorFlow 2.14.1, numpy 1.26,
tensorflow-privacy 0.9.0), never imports torch, and prints compare.py's result lines.

The DP step is tf-privacy's vectorized DP-SGD: ``VectorizedDPKerasSGDOptimizer`` with one microbatch per example
(per-example clipping, as the torch providers do), clip C = 1, noise multiplier 1, lr 0.01, a vector of per-example
losses, inside one ``tf.function``. Models mirror compare.py's workloads in Keras (channels-last images). The same
process first times TensorFlow's non-private step of the same model (reported in the row's note), then the DP
step; the peak memory is that of the DP step (the larger one).

    <tf venv>/bin/python bench/compare_tf.py --worker '{"provider": "tf-privacy", "workload": "mlp-256", ...}'
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import compare  # stdlib-only at import time: its result format, caps and RSS probe

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

CLIP, SIGMA, LR = 1.0, 1.0, 0.01


def build_model(arch: dict):
    """The Keras twin of a compare.py workload's plain model (same layer shapes as the torch model)."""
    import tensorflow as tf

    layers = tf.keras.layers
    kind = arch["kind"]
    if kind == "mlp":
        hidden = [layers.Dense(arch["hidden"], activation="relu") for _ in range(arch["depth"])]
        return tf.keras.Sequential([tf.keras.Input((arch["inputs"],)), *hidden, layers.Dense(10)])
    if kind == "opacus_cnn":  # torch: Conv2d(1, 16, 8, stride 2, padding 3), MaxPool2d(2, 1), Conv2d(16, 32, 4, 2) ...
        return tf.keras.Sequential([
            tf.keras.Input((28, 28, 1)), layers.ZeroPadding2D(3), layers.Conv2D(16, 8, strides=2, activation="relu"),
            layers.MaxPool2D(2, strides=1), layers.Conv2D(32, 4, strides=2, activation="relu"),
            layers.MaxPool2D(2, strides=1), layers.Flatten(), layers.Dense(32, activation="relu"), layers.Dense(10),
        ])  # fmt: skip
    if kind == "vgg5":

        class GroupSort2(layers.Layer):
            def call(self, x):
                a, b = tf.split(x, 2, axis=-1)
                return tf.concat([tf.minimum(a, b), tf.maximum(a, b)], axis=-1)

        class L2NormPool2d(layers.Layer):
            def call(self, x):
                return tf.sqrt(tf.maximum(tf.nn.avg_pool2d(x * x, 2, 2, "VALID") * 4.0, 0.0))

        def conv(channels):
            return [layers.Conv2D(channels, 3, padding="same", use_bias=False), GroupSort2()]

        c1, c2 = arch["c1"], arch["c2"]
        return tf.keras.Sequential([
            tf.keras.Input((32, 32, 3)), *conv(c1), *conv(c1), L2NormPool2d(), *conv(c2), *conv(c2), L2NormPool2d(),
            layers.Flatten(), layers.Dense(10, use_bias=False),
        ])  # fmt: skip
    if kind == "transformer":  # bench_dpsgd.TokenTransformer
        seq, d, vocab = arch["seq"], arch["d"], arch["vocab"]

        class Block(layers.Layer):
            def __init__(self):
                super().__init__()
                self.tokens, self.positions = layers.Embedding(vocab, d), layers.Embedding(seq, d)
                self.norm1, self.norm2 = (layers.LayerNormalization(epsilon=1e-5) for _ in range(2))
                self.qkv, self.proj = layers.Dense(3 * d), layers.Dense(d)
                self.fc1, self.fc2 = layers.Dense(4 * d, activation="relu"), layers.Dense(d)
                self.head = layers.Dense(10)

            def call(self, idx):
                x = self.tokens(idx) + self.positions(tf.range(seq))[None]
                q, k, v = tf.split(self.qkv(self.norm1(x)), 3, axis=-1)
                att = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / d**0.5, axis=-1)
                x = x + self.proj(tf.matmul(att, v))
                x = x + self.fc2(self.fc1(self.norm2(x)))
                return self.head(tf.reduce_mean(x, axis=1))

        model = tf.keras.Sequential([tf.keras.Input((seq,), dtype=tf.int32), Block()])
        return model
    raise ValueError(f"compare_tf.py has no Keras model of kind {kind!r}")


def inputs(arch: dict, batch: int):
    import numpy as np

    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, size=batch).astype("int32")
    kind = arch["kind"]
    if kind == "mlp":
        return rng.standard_normal((batch, arch["inputs"]), dtype="float32"), y
    if kind == "opacus_cnn":
        return rng.standard_normal((batch, 28, 28, 1), dtype="float32"), y
    if kind == "vgg5":
        return rng.standard_normal((batch, 32, 32, 3), dtype="float32"), y
    return rng.integers(0, arch["vocab"], size=(batch, arch["seq"])).astype("int32"), y


def make_step(arch: dict, batch: int, private: bool):
    """(step function running one training step and returning the loss, trainable parameter count)."""
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    model = build_model(arch)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=tf.keras.losses.Reduction.NONE)
    if private:
        from tensorflow_privacy import VectorizedDPKerasSGDOptimizer

        optimizer = VectorizedDPKerasSGDOptimizer(l2_norm_clip=CLIP, noise_multiplier=SIGMA, num_microbatches=batch,
                                                  learning_rate=LR)  # fmt: skip
    else:
        optimizer = tf.keras.optimizers.legacy.SGD(learning_rate=LR)
    x, y = (tf.constant(a) for a in inputs(arch, batch))

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            losses = loss_fn(y, model(x, training=True))  # per-example losses [B]
            loss = losses if private else tf.reduce_mean(losses)
        optimizer.minimize(loss, model.trainable_variables, tape=tape)
        return tf.reduce_mean(losses)

    params = sum(int(tf.size(v)) for v in model.trainable_variables)
    return (lambda: float(train_step(x, y))), params  # float(): waits for the step (GPU too)


def time_step(step, repeats: int, warmup: int) -> tuple[float, float, float]:
    for _ in range(max(warmup, 1)):  # the first call traces the tf.function
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 9
    return statistics.median(times), q[1], q[7]


def worker(job: dict) -> int:
    import tensorflow as tf
    import tensorflow_privacy

    gpu = job["device"].startswith("cuda")
    if job.get("threads"):
        tf.config.threading.set_intra_op_parallelism_threads(job["threads"])
        tf.config.threading.set_inter_op_parallelism_threads(job["threads"])
    for device in tf.config.list_physical_devices("GPU"):
        tf.config.experimental.set_memory_growth(device, True)
    if gpu and not tf.config.list_physical_devices("GPU"):
        print("compare_tf.py: TensorFlow sees no GPU; timing on CPU", file=sys.stderr)
        gpu = False
    base = 0.0 if gpu else compare.warm_baseline(lambda: make_step(job["arch"], compare.WARM_BATCH, private=True)[0])
    batches = job["batches"]
    for i, batch in enumerate(batches):
        nxt = batches[i + 1] if i + 1 < len(batches) else None
        result = dict(provider=job["provider"], workload=job["workload"], batch=batch, pid=os.getpid(),
                      library_version=f"{tensorflow_privacy.__version__} (tensorflow {tf.__version__})",
                      mem_kind="tf-gpu-peak" if gpu else "cpu-peak-rss-delta")  # fmt: skip
        try:
            step, _ = make_step(job["arch"], batch, private=False)
            plain = time_step(step, max(job["repeats"] // 2, 1), 1)[0]
            del step
            gc.collect()
            if gpu:
                tf.config.experimental.reset_memory_stats("GPU:0")
            step, result["params"] = make_step(job["arch"], batch, private=True)
            med, p20, p80 = time_step(step, job["repeats"], job["warmup"])
        except (tf.errors.ResourceExhaustedError, MemoryError) as err:
            compare.emit(dict(result, status="oom", stopped_by=f"out of memory at batch {batch}", note=str(err)[:200]))
            return 0
        peak = tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20 if gpu else compare.maxrss_mb() - base
        over = not gpu and job["memory_budget_mb"] and peak > job["memory_budget_mb"]
        stop = compare.next_stop(job, batch, nxt, med, peak)
        if over:
            stop = f"memory budget {job['memory_budget_mb']:.0f} MB exceeded at batch {batch}"
        note = f"TensorFlow non-private step {plain:.2f} ms"
        compare.emit(dict(result, status="over-budget" if over else "ok", median_ms=med, p20_ms=p20, p80_ms=p80,
                          peak_mem_mb=peak, stopped_by=stop, note=note))  # fmt: skip
        del step
        gc.collect()
        if stop:
            return 0
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", metavar="JOB", required=True, help="the job, as compare.py writes it (JSON)")
    return worker(json.loads(parser.parse_args(argv).worker))


if __name__ == "__main__":
    sys.exit(main())
