"""``mtl generate --iteration N`` reads a committed iteration other than the latest; an
``iter_NNNNNNN`` directory given as the checkpoint is read as its parent at that iteration,
with a hint saying so; an iteration that is not there is a clean error listing those that are."""


def test_iteration_and_an_iter_directory(mtl, ok, clean_error, tiny_toml, workdir):
    ok(mtl("train", tiny_toml, "--set", "ckpt.interval=1"))
    args = ("--prompt", "Hi", "--max-new-tokens", 4, "--temperature", 0, "--show-ids")
    first = ok(mtl("generate", "ckpt", "--iteration", 1, *args))
    hinted = ok(mtl("generate", workdir / "ckpt" / "iter_0000001", *args))
    assert f"reading it as `mtl generate {workdir / 'ckpt'} --iteration 1`" in hinted
    assert hinted.endswith(first)  # the same model: the hint line, then the same text and ids
    clean_error(mtl("generate", "ckpt", "--iteration", 5, *args), "holds no committed iteration 5", "1, 2")
    clean_error(mtl("generate", workdir / "ckpt" / "iter_0000001", "--iteration", 2, *args),
                "is iteration 1 but --iteration 2")
