from pyserve.cli import main

main()
