from mtl.cli.main import main

main()
