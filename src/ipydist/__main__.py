from ipydist.cli import main

main()
